"""Our Triton kernels for the CUDA backend; each is tested against the torch backend's ops under
TRITON_INTERPRET=1 on the CPU (tests/kernels/), in float32 and float16."""
