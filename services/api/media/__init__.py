"""Image inputs at the gateway: fetched (fetch.py) and decoded and checked (images.py) before any worker sees them."""
