"""Start-up refusals a user can fix: what is wrong and the setting or command that fixes it.

``mlpair serve …`` prints a :class:`StartupError` as one line on stderr and exits 2 (a
configuration error); any other start-up failure exits 1. Tracebacks appear only with
``mlpair --debug``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic_settings import BaseSettings, SettingsError


class StartupError(Exception):
    """A configuration or environment problem found before serving (port in use, no model repository,
    CUDA asked for but not active). The message is one line: the problem, then the fix."""


def require_trained(root: Path, names: Iterable[str], setting: str) -> None:
    """Refuses to start when the model repository holds no version of a model to serve.

    Args:
        root: the model repository.
        names: the models to serve; empty means "whatever the repository holds".
        setting: the environment variable that points at the repository, e.g. ``INFERENCE_MODEL_REPOSITORY``.

    Raises:
        StartupError: ``root`` is missing or empty, or lacks a trained version of one of ``names``;
            the message says to run ``mlpair train`` (or to point ``setting`` elsewhere).
    """
    from mlpair.contracts.manifest import list_versions

    names = list(names)
    fix = (
        f"run `mlpair train --model-repository {root}` first, or point {setting} "
        "(--model-repository) at a trained repository"
    )
    if not root.is_dir() or not any(p.is_dir() and not p.name.startswith(".") for p in root.iterdir()):
        raise StartupError(f"model repository {root} is {'empty' if root.is_dir() else 'missing'}: {fix}")
    if untrained := [n for n in names if not list_versions(root, n)]:
        raise StartupError(f"no trained version of {', '.join(map(repr, untrained))} under {root}: {fix}")


def invalid_settings(settings_cls: type[BaseSettings], exc: ValidationError) -> StartupError:
    """One line naming each invalid setting as its flag and environment variable, e.g.
    ``invalid setting --port / PREDICTION_PORT: Input should be a valid integer``."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    problems = []
    for error in exc.errors(include_url=False):
        field = str(error["loc"][0]) if error["loc"] else ""
        if field in settings_cls.model_fields:
            problems.append(f"--{field.replace('_', '-')} / {prefix}{field.upper()}: {error['msg']}")
        else:  # a rule over several settings: its message names them
            problems.append(error["msg"].removeprefix("Value error, "))
    return StartupError("invalid setting " + "; ".join(problems))


def unparsable_setting(settings_cls: type[BaseSettings], exc: SettingsError) -> StartupError:
    """One line for an environment value pydantic-settings could not parse: a list or map setting
    must be JSON there, e.g. ``invalid setting --models / PREDICTION_MODELS: not JSON; …``."""
    import re

    prefix = settings_cls.model_config.get("env_prefix", "")
    found = re.search(r'field "(\w+)"', str(exc))
    field = found.group(1) if found and found.group(1) in settings_cls.model_fields else None
    if field is None:
        return StartupError(f"invalid setting: {exc}")
    annotation = str(settings_cls.model_fields[field].annotation).lower()
    example = (
        '{"credit-risk": ["1"]}' if "dict" in annotation or "mapping" in annotation else '["credit-risk", "churn"]'
    )
    return StartupError(
        f"invalid setting --{field.replace('_', '-')} / {prefix}{field.upper()}: the environment value is "
        f"not JSON; a list or map setting is written as JSON there, e.g. {prefix}{field.upper()}='{example}'"
    )
