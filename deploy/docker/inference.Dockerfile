# syntax=docker/dockerfile:1
#
# InferenceService image for the GPU node pool.
#
# CUDA 12 runtime + cuDNN 9 base: onnxruntime-gpu's CUDA execution provider loads those libraries
# at session creation, and the "runtime" flavour carries them without the compilers of "devel".
# The CUDA major must match the onnxruntime-gpu wheel's (pyproject pins one built for CUDA 12);
# the build stage runs deploy/docker/check_cuda_libs.py, which fails the build when the CUDA
# provider's library needs anything the image lacks (other than the driver's libcuda.so.1).
# Python 3.11 comes from Ubuntu 22.04's archive so the build and runtime stages share one
# interpreter path (/usr/bin/python3.11) and the copied virtualenv stays valid.
# No torch: the `inference-gpu` extra brings onnxruntime-gpu only, and the build fails if torch
# slipped in through a dependency.
#
# Build from the repository root (the context .dockerignore allows in only what pip needs):
#   docker build -f deploy/docker/inference.Dockerfile -t mlpair-inference:dev .

ARG CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu22.04

# ---- python: the CUDA runtime plus a bare interpreter, shared by both stages below ----
FROM ${CUDA_IMAGE} AS python
# Build-time only (an ARG, not an ENV, so it does not linger in the image).
ARG DEBIAN_FRONTEND=noninteractive
# Versions come from the pinned base image's Ubuntu release; exact apt pins would break the build
# whenever the archive publishes a security update, so DL3008 is waived here and below.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 \
    && rm -rf /var/lib/apt/lists/*

# ---- build: a virtualenv with mlpair[inference-gpu]; pip, venv, CA certificates (for pip's
# downloads) and the sources stay here ----
FROM python AS build
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Metadata first, then the package folders that pyproject's package-dir names.
COPY pyproject.toml README.md ./
COPY mlpair ./mlpair
COPY services ./services
# DL3013 wants `pip install name==version`; this installs the local project, whose dependency
# bounds live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[inference-gpu]' \
    && if pip show torch >/dev/null 2>&1; then echo "torch must not ship in the inference image" >&2; exit 1; fi \
    && python -c "import onnxruntime, mlpair"
# The CUDA provider resolves against this image's CUDA (CUDA_VERSION, set by the base image).
COPY deploy/docker/check_cuda_libs.py /src/check_cuda_libs.py
RUN python /src/check_cuda_libs.py

# ---- runtime: interpreter + virtualenv, a fixed non-root user, nothing else ----
FROM python AS runtime
# A numeric UID/GID so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 mlpair \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin mlpair
COPY --from=build /opt/venv /opt/venv
# Bytecode was compiled by pip at install time; a read-only root filesystem can't take more.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    INFERENCE_HOST=0.0.0.0 \
    INFERENCE_PORT=8001 \
    INFERENCE_METRICS_PORT=8002 \
    INFERENCE_MODEL_REPOSITORY=/models \
    INFERENCE_EXECUTION_PROVIDER=cuda
USER 10001:10001
# 8001 gRPC (InferenceService, OIP, grpc.health.v1); 8002 Prometheus metrics.
EXPOSE 8001 8002
# Docker-level health through the gRPC health protocol (SERVING only after load + warm-up).
# Kubernetes ignores HEALTHCHECK and uses its native gRPC probes instead (deploy/k8s).
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["/opt/venv/bin/mlpair", "health", "--target", "127.0.0.1:8001"]
ENTRYPOINT ["/opt/venv/bin/mlpair"]
CMD ["serve", "inference"]
