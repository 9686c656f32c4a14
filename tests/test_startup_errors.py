"""Start-up failures as a user meets them: one line on stderr that names the fix, exit 2 for a
configuration error, 1 for anything else, the traceback only with ``mlpair --debug``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import CONFIG_DIR

# A failure that is not a configuration error: the service's own start raising something unexpected.
UNEXPECTED = """
import sys
import mlpair.inference.server as server
async def serve(settings, **kwargs):
    raise RuntimeError("the runtime fell over")
server.serve = serve
from mlpair.cli import main
sys.exit(main(sys.argv[1:]))
"""


def mlpair(*args: str, code: str | None = None, cwd=None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "mlpair.cli", *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("INFERENCE_", "PREDICTION_"))}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd, env={**base, **(env or {})})


def last_line(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("role", ["inference", "prediction"])
def test_an_empty_model_repository_says_to_run_mlpair_train(role, workers, tmp_path):
    empty = tmp_path / "models"
    empty.mkdir()
    config = ("--config-dir", str(CONFIG_DIR)) if role == "prediction" else ()
    out = mlpair("serve", role, "--model-repository", str(empty), "--port", "0", "--metrics-port", "0",
                 "--workers", workers, *config, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    # One line, also with 2 workers: the supervisor checks before starting them, not each worker alike.
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert last_line(out).startswith(f"mlpair: {role} service: model repository {empty} is empty: "), out.stderr
    assert f"run `mlpair train --model-repository {empty}`" in last_line(out)
    assert "Traceback" not in out.stderr


def test_a_missing_model_repository_shows_the_traceback_only_with_debug(tmp_path):
    missing = tmp_path / "nowhere"
    args = ("serve", "inference", "--model-repository", str(missing), "--port", "0", "--metrics-port", "0")
    out = mlpair(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"model repository {missing} is missing: run `mlpair train --model-repository {missing}`" in last_line(out)
    debug = mlpair("--debug", *args)
    assert debug.returncode == 2
    assert "Traceback" in debug.stderr and "StartupError" in debug.stderr
    assert last_line(debug) == last_line(out)


@pytest.mark.parametrize(("role", "flag", "env"), [("inference", "--max-batch-size", "INFERENCE_MAX_BATCH_SIZE"),
                                                   ("prediction", "--port", "PREDICTION_PORT")])
def test_an_invalid_setting_is_one_line_naming_the_flag_and_variable(role, flag, env):
    out = mlpair("serve", role, flag, "lots")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [last_line(out)], "exactly one line"
    assert last_line(out).startswith(f"mlpair: {role} service: invalid setting {flag} / {env}: "), out.stderr


@pytest.mark.parametrize(("env", "value", "example"), [
    ("PREDICTION_MODELS", "credit-risk,churn", """PREDICTION_MODELS='["credit-risk", "churn"]'"""),
    ("PREDICTION_ENSEMBLES", "credit-risk=1", """PREDICTION_ENSEMBLES='{"credit-risk": ["1"]}'"""),
])
def test_a_list_or_map_setting_that_is_not_json_names_the_variable_and_its_form(env, value, example):
    # The environment carries a list or a map as JSON; a plain value used to end in the settings
    # library's own message (exit 1) that named neither the variable nor the form it needs.
    out = mlpair("serve", "prediction", "--workers", "1", env={env: value})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [last_line(out)], "exactly one line"
    flag = "--" + env.removeprefix("PREDICTION_").lower()
    assert last_line(out).startswith(f"mlpair: prediction service: invalid setting {flag} / {env}: "), out.stderr
    assert last_line(out).endswith(f"e.g. {example}"), out.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serving_families_without_the_default_one_names_the_setting_that_picks_it(model_repository, workers):
    # With 2 workers the supervisor checks the configuration before starting them: one line, not
    # the same refusal from each worker and a supervisor's line after them.
    out = mlpair("serve", "prediction", "--workers", workers, "--models", "churn", "--model-repository",
                 str(model_repository), "--config-dir", str(CONFIG_DIR), "--port", "0", "--metrics-port", "0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [last_line(out)], "exactly one line"
    assert last_line(out) == ("mlpair: prediction service: default model family 'credit-risk' is not among the "
                              "served ['churn']: set --model-name / PREDICTION_MODEL_NAME to one of them"), out.stderr


def test_an_unexpected_failure_is_one_line_and_exit_1_with_the_traceback_under_debug():
    out = mlpair("serve", "inference", "--workers", "1", "--metrics-port", "0", code=UNEXPECTED)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [last_line(out)], "exactly one line"
    assert last_line(out) == ("mlpair: inference service failed to start: RuntimeError: the runtime fell over "
                              "(mlpair --debug … for the traceback)")
    debug = mlpair("--debug", "serve", "inference", "--workers", "1", "--metrics-port", "0", code=UNEXPECTED)
    assert debug.returncode == 1
    assert debug.stderr.count("Traceback") == 1, debug.stderr
    assert "in serve\nRuntimeError: the runtime fell over\n" in debug.stderr


def test_mlpair_relay_refuses_a_relay_port_in_use_and_an_unmigrated_ledger_in_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = mlpair("relay", "--host", "127.0.0.1", "--relay-port", str(port), "--relay-metrics-port", "0")
    assert out.returncode == 2, out.stderr
    assert last_line(out) == (f"mlpair: relay: relay port {port} is in use on 127.0.0.1 (another server is bound "
                              "to it); stop it or choose another relay_port")
    out = mlpair("relay", "--ledger-url", f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}",
                 "--crm-url", f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}", "--relay-port", "0",
                 "--relay-metrics-port", "0")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "run `mlpair migrate`" in last_line(out)
