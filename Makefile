# Every target runs inside a local virtualenv that `make venv` creates on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_REPOSITORY ?= var/models

.PHONY: venv protos train demo test clean

venv: $(STAMP)

# Reinstall when the dependency list changes. torch==2.13.0 is pinned in pyproject so pip takes
# the local CPU wheel rather than a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Regenerate the gRPC/protobuf modules into mlpair/api (never edit those by hand).
protos: $(STAMP)
	$(PY) -m mlpair.protogen

train: $(STAMP)
	$(VENV)/bin/mlpair train --model-repository $(MODEL_REPOSITORY)

demo: $(STAMP)
	$(VENV)/bin/mlpair demo --model-repository $(MODEL_REPOSITORY)

# promtool (from Debian's prometheus package) validates deploy/observability's alerting rules offline.
$(VENV)/bin/promtool: | $(STAMP)
	bash deploy/observability/fetch-promtool.sh $@

test: $(STAMP) $(VENV)/bin/promtool
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) var .pytest_cache
