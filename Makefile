# Every target runs inside a local virtualenv that `make venv` creates on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
MODEL_REPOSITORY ?= var/models

BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf

.PHONY: venv tools protos protos-baseline train demo lint test test-fast bench bench-inference bench-predict gpu-check soak clean

venv: $(STAMP)

# Reinstall when the dependency list changes. torch==2.13.0 is pinned in pyproject so pip takes
# the local CPU wheel rather than a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(call install,dev)

# $(call install,EXTRA): the virtualenv with the project and that extra, then the target's stamp.
# setuptools warns on every editable install that the `mlpair/` folder in the working directory may
# shadow the package: here it is the package, so that one warning is silenced.
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e '.[$(1)]'
	touch $@
endef

PROTO_DEPS := .tools/proto-deps/google/rpc/status.proto

# buf (proto lint and breaking-change checks) from the npm registry; skipped if npm is absent.
# buf cannot fetch googleapis here, so google/rpc/status.proto comes from the venv's
# googleapis-common-protos (the same file protoc compiles against).
tools: $(BUF) $(PROTO_DEPS)
$(BUF):
	@if command -v npm >/dev/null; then npm install --silent --prefix .tools @bufbuild/buf@$(BUF_VERSION); \
	else echo "npm not found: buf checks will be skipped"; fi
$(PROTO_DEPS): $(STAMP)
	mkdir -p $(dir $@)
	cp "$$($(PY) -c 'import google.rpc.status_pb2 as m, pathlib; print(pathlib.Path(m.__file__).with_suffix("").with_name("status.proto"))')" $@

# Regenerate the gRPC/protobuf modules into mlpair/api (never edit those by hand).
protos: $(STAMP)
	$(PY) -m mlpair.protogen

# Record the released wire contract that `buf breaking` compares against (run on a release).
protos-baseline: $(BUF)
	$(BUF) build protos -o protos/baseline.binpb

train: $(STAMP)
	$(VENV)/bin/mlpair train --model-repository $(MODEL_REPOSITORY)

# The demo installs only its own extra (training, both services, the report): no test or deploy tools.
$(DEMO_STAMP): pyproject.toml
	$(call install,demo)

demo: $(DEMO_STAMP)
	$(VENV)/bin/mlpair demo --model-repository $(MODEL_REPOSITORY)

# promtool (from Debian's prometheus package) validates deploy/observability's alerting rules offline;
# the prometheus server from the same package runs them live against both services in `make test`.
$(VENV)/bin/promtool $(VENV)/bin/prometheus: | $(STAMP)
	bash deploy/observability/fetch-promtool.sh $@

# PgBouncer (from Debian's pgbouncer package, unpacked under the venv) puts the ledger and the CRM
# behind a real transaction-mode pooler in `make test`.
$(VENV)/bin/pgbouncer: | $(STAMP)
	bash tests/fetch-pgbouncer.sh $@

# ruff's lint on the product, the tests and the benchmarks (pyproject.toml says which rules where),
# its format check on the product only, and mypy on the product: the `mlpair` namespace package's
# three portions (mlpair/, services/inference/, services/prediction/), each folder its import path.
lint: $(STAMP)
	$(VENV)/bin/ruff check mlpair services tests bench
	$(VENV)/bin/ruff format --check mlpair services
	$(VENV)/bin/mypy --config-file pyproject.toml

test: $(STAMP) tools $(VENV)/bin/promtool $(VENV)/bin/prometheus $(VENV)/bin/pgbouncer lint
	$(PY) -m pytest -q --durations=25

# Unit tests only (under a minute): the modules that start no process, no server and no database —
# the contracts, the prediction wing's pure stages, job chunking and the structure checks. No lint.
FAST_TESTS := tests/contracts tests/test_structure.py tests/jobs/test_chunks.py \
	$(addprefix tests/prediction/test_,calibration.py checks.py columns.py explain.py idempotency.py \
	layers.py packed.py policy.py scorer.py)
test-fast: $(STAMP)
	$(PY) -m pytest -q $(FAST_TESTS)

# Benchmark (not a test): InferenceService side by side with PyTriton, tritonserver + Python backend,
# MLServer and KServe (each in its own pinned venv under var/bench/venvs, installed on first run),
# the same ONNX files and batching, one OIP load generator, interleaved; cold start to SERVING.
# JSON lines and a table on stdout, var/bench/results.jsonl and var/bench/table.md. ~10 min on 2 cores.
bench: $(STAMP)
	$(PY) bench/side_by_side.py --model-repository $(MODEL_REPOSITORY)

# Benchmark (not a test): InferenceService over OIP gRPC at concurrency 1/16/64, batching on and
# off, beside the in-process runtime ceiling and a do-nothing gRPC server; JSON lines on stdout.
bench-inference: $(STAMP)
	$(PY) bench/inference.py --model-repository $(MODEL_REPOSITORY)

# Benchmark (not a test): PredictionService end to end (Predict, BatchPredict; CRM write on, cache
# misses) and the added latency of the prediction hop over a direct Infer call, beside a do-nothing
# PredictionService (bench/null_prediction.py, the floor of a Python gRPC hop), and Predict interleaved
# with a KServe transformer -> predictor chain doing the same business work (bench/kserve_chain.py;
# KServe in its own pinned venv under var/bench/venvs, installed on first run); JSON lines + a table.
bench-predict: $(STAMP)
	$(PY) bench/predict_load.py --model-repository $(MODEL_REPOSITORY)

# GPU proof (not a test; needs an NVIDIA GPU and a CUDA build of torch): the torch runtime on CUDA in
# process and through the service, fp32 / fp16 / CUDA graphs, a compute-heavy variant, parity and
# determinism (bench/gpu_check.py; its docstring says how to run the two steps on separate machines).
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check prepare --model-repository $(MODEL_REPOSITORY) --bundle var/gpu-bundle
	$(PY) -m bench.gpu_check run --bundle var/gpu-bundle --json var/gpu-check.json

# Soak and faults (not part of `make test`, which runs its --short version): both services as
# processes under sustained load, kill -9 of each, SIGTERM drains, a CRM outage; exits 1 on a violation.
soak: $(STAMP)
	$(PY) bench/soak.py --model-repository $(MODEL_REPOSITORY)

clean:
	rm -rf $(VENV) var .pytest_cache .tools
