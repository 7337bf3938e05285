"""The CPU backend's C kernels: their sources (csrc/), their build (build.py) and their loading as torch ops (load.py)."""
