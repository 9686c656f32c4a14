# syntax=docker/dockerfile:1
#
# PredictionService image for the CPU node pool.
#
# Slim Debian Python 3.11 base; the `prediction` extra brings SQLAlchemy, aiosqlite, asyncpg,
# Alembic, redis, scipy and uvloop (all with wheels), and mlpair itself is pure Python: no compiler
# in either stage. No torch and no ONNX Runtime: the model runs in InferenceService; the build fails
# if either slipped in through a dependency.
#
# Build from the repository root:
#   docker build -f deploy/docker/prediction.Dockerfile -t mlpair-prediction:dev .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtualenv with mlpair[prediction]; pip and the sources stay here ----
FROM ${PYTHON_IMAGE} AS build
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mlpair ./mlpair
COPY services ./services
# DL3013 wants `pip install name==version`; this installs the local project, whose dependency
# bounds live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[prediction]' \
    && for heavy in torch onnxruntime onnxruntime-gpu; do \
         if pip show "$heavy" >/dev/null 2>&1; then echo "$heavy must not ship in the prediction image" >&2; exit 1; fi; \
       done \
    && python -c "import sqlalchemy, asyncpg, alembic, redis.asyncio, scipy, uvloop, mlpair"

# ---- runtime: the same base (same interpreter path), the virtualenv, a non-root user ----
FROM ${PYTHON_IMAGE} AS runtime
# No volume and no writable folder: every decision is recorded in the decision ledger the
# replicas share (PREDICTION_LEDGER_URL, a PostgreSQL URL given at run time with the CRM's, as
# the Kubernetes Secret prediction-ledger does), so the container keeps nothing a restart could
# lose and can run with a read-only root filesystem. `mlpair migrate` (the same image, run before
# the service) creates the schemas.
RUN groupadd --system --gid 10001 mlpair \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin mlpair
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PREDICTION_HOST=0.0.0.0 \
    PREDICTION_PORT=9001 \
    PREDICTION_METRICS_PORT=9002 \
    PREDICTION_MODEL_REPOSITORY=/models \
    PREDICTION_CONFIG_DIR=/etc/mlpair/config
USER 10001:10001
# 9001 gRPC (PredictionService, grpc.health.v1); 9002 Prometheus metrics. The same image runs the
# outbox relay (`mlpair relay`): 9003 grpc.health.v1, 9004 metrics. HEALTHCHECK names the server; a
# relay container under plain Docker sets its own:
#   docker run --health-cmd "/opt/venv/bin/mlpair health --target 127.0.0.1:9003" … relay
EXPOSE 9001 9002 9003 9004
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["/opt/venv/bin/mlpair", "health", "--target", "127.0.0.1:9001"]
ENTRYPOINT ["/opt/venv/bin/mlpair"]
CMD ["serve", "prediction"]
