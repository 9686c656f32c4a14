"""``mlpair serve inference`` and ``mlpair serve prediction``: one serving process, or a supervisor
of ``settings.workers`` of them (:mod:`mlpair.workers`); ``mlpair relay``: the outbox relay in a
process of its own (:mod:`mlpair.prediction.relay_server`).

Every server setting is a flag and an environment variable (``INFERENCE_*`` / ``PREDICTION_*``); a
flag wins over the environment, which wins over the default. A refusal the user can fix (a port in
use, an invalid setting, a missing model repository) is one line and exit 2; anything else one
line and exit 1 (:func:`mlpair.cli._fail`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic_settings import BaseSettings

if TYPE_CHECKING:
    from mlpair.inference.settings import InferenceSettings
    from mlpair.prediction.settings import PredictionSettings

S = TypeVar("S", bound=BaseSettings)
T = TypeVar("T")
# the settings of one of the two services (both carry host, port, workers, logging and tracing fields)
Settings = TypeVar("Settings", "InferenceSettings", "PredictionSettings")
Settings_contra = TypeVar("Settings_contra", "InferenceSettings", "PredictionSettings", contravariant=True)


class Serve(Protocol[Settings_contra]):
    """A service's ``serve(settings, shared_port=…)`` coroutine function (runs until SIGTERM)."""

    def __call__(self, settings: Settings_contra, *, shared_port: bool = False) -> Coroutine[Any, Any, None]:
        """Serves with ``settings`` until SIGTERM or SIGINT, then drains and returns; with
        ``shared_port`` as one of a supervisor's workers, all bound to the same port (``SO_REUSEPORT``).
        """


def run_loop(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """Runs ``main`` to its end on a new event loop of the kind ``event_loop`` names: ``uvloop``
    (``uvloop.run``) or ``asyncio`` (``asyncio.run``) and returns its result; the loop is closed
    afterwards either way.

    Raises:
        StartupError: ``uvloop`` is asked for and not installed (the ``prediction`` extra has it).
    """
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError as exc:
            main.close()  # never awaited: no "coroutine was never awaited" warning
            from mlpair.startup import StartupError

            raise StartupError(
                "event_loop is uvloop but uvloop is not installed: pip install uvloop, or set event_loop to asyncio"
            ) from exc
        return uvloop.run(main)
    return asyncio.run(main)


def settings_from_args(settings_cls: type[S], args: argparse.Namespace) -> S:
    """The settings from flags, then the environment, then defaults.

    Raises:
        StartupError: a value is invalid; one line naming each offending flag and variable.
    """
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from mlpair.startup import invalid_settings, unparsable_setting

    given = {k: v for k, v in vars(args).items() if k in settings_cls.model_fields and v is not None}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        raise invalid_settings(settings_cls, exc) from exc
    except SettingsError as exc:  # an environment value of a list or map setting that is not JSON
        raise unparsable_setting(settings_cls, exc) from exc


def serve_inference(args: argparse.Namespace) -> int:
    """``mlpair serve inference``: InferenceService until SIGTERM; the exit code."""
    from mlpair.inference.settings import InferenceSettings
    from mlpair.workers import gpu_visible

    settings = settings_from_args(InferenceSettings, args)
    # the torch runtime follows execution_provider too; "auto" takes a GPU when one is visible
    on_gpu = settings.execution_provider == "cuda" or (settings.execution_provider == "auto" and gpu_visible())
    return run_server("inference", settings, _inference, on_gpu=on_gpu, preflight=_inference_configuration)


def serve_prediction(args: argparse.Namespace) -> int:
    """``mlpair serve prediction``: PredictionService until SIGTERM; the exit code."""
    from mlpair.prediction.settings import PredictionSettings

    settings = settings_from_args(PredictionSettings, args)
    return run_server("prediction", settings, _prediction, preflight=_prediction_configuration)


# What `mlpair relay` reads of PredictionSettings (its flags; the other PREDICTION_* variables are
# accepted and ignored, so the relay can share the serving container's ConfigMap).
RELAY_SETTINGS = (
    "host",
    "event_loop",
    "models",
    "ledger_url",
    "ledger_timeout_ms",
    "ledger_pool_size",
    "ledger_statement_cache_size",
    "ledger_synchronous",
    "crm_url",
    "crm_timeout_ms",
    "crm_statement_cache_size",
    "relay_batch_size",
    "relay_concurrency",
    "relay_linger_ms",
    "relay_backoff_max_ms",
    "relay_poll_ms",
    "relay_port",
    "relay_metrics_port",
    "health_interval_ms",
    "shutdown_grace_s",
    "log_level",
    "log_format",
)


def relay(args: argparse.Namespace) -> int:
    """``mlpair relay``: delivers the decision ledger to the CRM database until SIGTERM; the exit
    code (0 after a clean stop, 2 for a refusal the user can fix, 1 for any other failure)."""
    from mlpair.cli import _fail
    from mlpair.logs import configure_logging
    from mlpair.prediction.settings import PredictionSettings
    from mlpair.startup import StartupError
    from mlpair.workers import check_port_free, port_error

    settings = settings_from_args(PredictionSettings, args)
    configure_logging("prediction", settings.log_level, settings.log_format)
    try:
        if settings.relay_port:
            check_port_free(settings.host, settings.relay_port, "relay port")  # at once, before any database work
        if settings.relay_metrics_port:
            from prometheus_client import start_http_server

            try:
                start_http_server(settings.relay_metrics_port, addr=settings.host)
            except OSError as exc:
                raise port_error(settings.host, settings.relay_metrics_port, exc, "relay metrics port") from exc
        from mlpair.prediction.relay_server import serve

        run_loop(serve(settings), settings.event_loop)
    except StartupError as exc:  # the user can fix it: one line, exit 2
        return _fail("relay", exc, 2)
    except Exception as exc:  # noqa: BLE001  (anything else: one line, exit 1, the traceback with --debug)
        return _fail("relay failed", exc, 1)
    return 0


# The servers are imported only once the port is known to be free: a refusal comes in about a
# second, not after the imports of ONNX Runtime, SQLAlchemy and SciPy.
async def _inference(settings: InferenceSettings, *, shared_port: bool = False) -> None:
    from mlpair.inference.server import serve

    await serve(settings, shared_port=shared_port)


async def _prediction(settings: PredictionSettings, *, shared_port: bool = False) -> None:
    from mlpair.prediction.server import serve

    await serve(settings, shared_port=shared_port)


def _inference_configuration(settings: InferenceSettings) -> None:
    """A supervisor's check before its workers start: every model to serve has a trained version
    (a refusal every worker would print alike, printed once)."""
    from mlpair.startup import require_trained

    if not settings.model_source:  # a remote source is checked by each worker, retried while unreachable
        require_trained(settings.model_repository, settings.models_to_serve(), "INFERENCE_MODEL_REPOSITORY")


def _prediction_configuration(settings: PredictionSettings) -> None:
    """A supervisor's check before its workers start: the families load as the settings say, and
    no pooler in front of the ledger or the CRM loses their cached prepared statements."""
    import asyncio

    from mlpair.prediction.composition import load_families
    from mlpair.prediction.recording.pooler import check_poolers

    load_families(settings)
    asyncio.run(check_poolers(settings))


def run_server(
    layer: str,
    settings: Settings,
    serve: Serve[Settings],
    *,
    on_gpu: bool = False,
    preflight: Callable[[Settings], None] | None = None,
) -> int:
    """One serving process, or a supervisor of ``settings.workers`` of them (:mod:`mlpair.workers`)
    that runs ``preflight(settings)`` before starting them."""
    import functools

    from mlpair.cli import _fail
    from mlpair.logs import configure_logging
    from mlpair.startup import StartupError
    from mlpair.workers import supervise, worker_count

    configure_logging(layer, settings.log_level, settings.log_format, sample_ratio=settings.log_sample_ratio)
    try:
        workers = worker_count(settings.workers, uses_gpu=on_gpu)
        if workers > 1:
            return supervise(
                layer,
                settings,
                workers,
                functools.partial(serve_process, layer, serve=serve, shared_port=True),
                preflight,
            )
    except StartupError as exc:
        return _fail(f"{layer} service", exc, 2)
    return serve_process(layer, settings, serve)


def serve_process(layer: str, settings: Settings, serve: Serve[Settings], *, shared_port: bool = False) -> int:
    """Serves until SIGTERM: alone (exclusive port, own metrics port), or as a supervisor's worker
    (``shared_port``: a fresh interpreter; the supervisor owns the port check and the metrics port).

    Returns:
        0 after a clean stop, 2 for a refusal the user can fix, 1 for any other failure.
    """
    from importlib.metadata import version

    from mlpair.cli import _fail
    from mlpair.logs import configure_logging
    from mlpair.startup import StartupError
    from mlpair.workers import check_port_free, port_error

    if shared_port:
        configure_logging(layer, settings.log_level, settings.log_format, sample_ratio=settings.log_sample_ratio)
    else:
        try:
            check_port_free(settings.host, settings.port)  # at once, before any model or database work
        except StartupError as exc:
            return _fail(f"{layer} service", exc, 2)

    from opentelemetry import trace

    from mlpair.observability.tracing import build_tracer_provider

    # The standard OTEL_* variables fill in what the project's own settings leave unset.
    sample_ratio = settings.trace_sample_ratio if "trace_sample_ratio" in settings.model_fields_set else None
    provider = build_tracer_provider(
        f"mlpair-{layer}",
        otlp_endpoint=settings.otlp_endpoint,
        sample_ratio=sample_ratio,
        service_version=version("mlpair"),
        environ=os.environ,
    )
    trace.set_tracer_provider(provider)
    try:
        if not shared_port and settings.metrics_port:
            from prometheus_client import start_http_server

            try:
                start_http_server(settings.metrics_port, addr=settings.host)
            except OSError as exc:
                raise port_error(settings.host, settings.metrics_port, exc, "metrics port") from exc
        run_loop(serve(settings, shared_port=shared_port), settings.event_loop)
    except StartupError as exc:  # the user can fix it: one line, exit 2
        return _fail(f"{layer} service", exc, 2)
    except Exception as exc:  # noqa: BLE001  (anything else: one line, exit 1, the traceback with --debug)
        return _fail(f"{layer} service failed to start", exc, 1)
    finally:
        provider.shutdown()  # flushes spans still batched for export
    return 0
