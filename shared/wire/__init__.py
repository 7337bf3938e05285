"""What travels on the bus: message schemas, subjects, KV events, LoRA orders, guided-decoding
specs, histograms and prefix-block hashes. Imports nothing above it in shared/."""
