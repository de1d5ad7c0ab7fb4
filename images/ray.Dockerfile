# The Ray image for the data plane (Ray head and worker Pods): Ray Serve, torch on the CPU and the
# project's workers package, which the Serve application imports (moe_workers.*).
#   docker build -f images/ray.Dockerfile -t ghcr.io/moe-operator/moe-ray:0.1.0 .
# scripts/testenv builds it with buildah on a debootstrap'd bookworm base (BASE), with torch taken
# from the wheel directory this machine's pip uses (PIP_FIND_LINKS, bound in) instead of an index.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG PIP_FIND_LINKS=
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# dependencies first: a change of the project's code rebuilds only the last layer
RUN pip install --no-cache-dir "torch==2.13.0" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
 && pip install --no-cache-dir "ray[serve]==2.60.0" "safetensors==0.8.0" "tokenizers==0.23.3" "numpy==2.4.6" "jinja2==3.1.6" "llguidance==1.9.1" \
      "pydantic==2.14.4" "PyYAML==6.0.4" "prometheus-client==0.26.0" "requests==2.34.2" "psutil==7.2.2"
# a C compiler: the replicas build the C kernels for the node's CPU at first use (the quantized
# experts' decoder, a decode step's products; moe_workers/model/native.py; without one, torch
# does the same work, several times slower)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator operator
COPY workers workers
RUN pip install --no-cache-dir --no-deps . && rm -rf /src
WORKDIR /
ENV HOME=/tmp PYTHONUNBUFFERED=1
# Serve's HTTP proxy admits generation requests through the project's gate before its router
# (moe_workers/serve/proxy/gate.py): a full app is refused at once instead of queued in the proxy
ENV RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=moe_workers.serve.proxy.gate:middlewares
