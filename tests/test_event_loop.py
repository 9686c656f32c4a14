"""The event loop each serving process runs on (``event_loop``): uvloop or the standard library's,
and a clear refusal when uvloop is asked for and missing."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import uvloop

from mlpair.commands.serve import RELAY_SETTINGS, run_loop
from mlpair.inference.settings import InferenceSettings
from mlpair.prediction.settings import PredictionSettings
from mlpair.startup import StartupError

# `mlpair` with uvloop unimportable, as where it is not installed.
WITHOUT_UVLOOP = """
import sys
sys.modules["uvloop"] = None
from mlpair.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("event_loop", "loop_type"), [("uvloop", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)])
def test_run_loop_runs_the_coroutine_on_the_loop_named_and_returns_its_result(event_loop, loop_type):
    async def main() -> asyncio.AbstractEventLoop:
        await asyncio.sleep(0.001)
        return asyncio.get_running_loop()

    loop = run_loop(main(), event_loop)
    assert isinstance(loop, loop_type) and loop.is_closed()
    assert (event_loop == "uvloop") == isinstance(loop, uvloop.Loop)


def test_prediction_runs_on_uvloop_and_inference_on_asyncio_by_default():
    """PredictionService's delays are 1 ms and more, which uvloop's millisecond timers keep;
    InferenceService measured no faster on uvloop (docs/decisions/0009-uvloop-for-predictionservice.md)."""
    assert PredictionSettings().event_loop == "uvloop"
    assert InferenceSettings().event_loop == "asyncio"
    assert "event_loop" in RELAY_SETTINGS  # `mlpair relay --event-loop`, PREDICTION_EVENT_LOOP


def test_a_missing_uvloop_is_a_startup_error_and_the_coroutine_is_not_left_unawaited(monkeypatch, recwarn):
    monkeypatch.setitem(sys.modules, "uvloop", None)
    ran = []

    async def main() -> None:
        ran.append(True)

    with pytest.raises(StartupError, match="event_loop is uvloop but uvloop is not installed"):
        run_loop(main(), "uvloop")
    assert not ran
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


SERVE = ("--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--workers", "1")


@pytest.mark.parametrize("command", [("serve", "inference", *SERVE), ("serve", "prediction", *SERVE),
                                     ("relay", "--host", "127.0.0.1", "--relay-port", "0", "--relay-metrics-port", "0")])
def test_serving_on_uvloop_where_it_is_missing_is_one_line_and_exit_2(command, tmp_path):
    out = subprocess.run([sys.executable, "-c", WITHOUT_UVLOOP, *command, "--event-loop", "uvloop"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "event_loop is uvloop but uvloop is not installed" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
