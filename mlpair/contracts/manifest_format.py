"""The model manifest's published format: a JSON Schema (``manifest.schema.json``, package data) and its version.

A manifest without ``format_version`` is format 1 (what releases before the format's publication
wrote, and what is written while the format is 1); a later format names itself. A reader checks the raw JSON
against the schema of the version it names before anything else reads it, and refuses a version
newer than it knows. The layout, the fields and the change policy: ``docs/model-format.md``.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

FORMAT_VERSION = 1
SCHEMA_FILE = "manifest.schema.json"


class FormatError(ValueError):
    """A manifest that does not follow the format it names; the message is one line naming the first problem."""


@functools.cache
def manifest_schema() -> dict[str, Any]:
    """The JSON Schema of format :data:`FORMAT_VERSION`, as shipped with the package."""
    return json.loads(resources.files("mlpair.contracts").joinpath(SCHEMA_FILE).read_text())


@functools.cache
def _validator():
    import jsonschema

    schema = manifest_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def check_manifest(raw: object) -> int:
    """Checks a manifest's parsed JSON against the format it names; returns that format version.

    Raises:
        FormatError: not an object; a ``format_version`` that is not a positive integer or is newer
            than :data:`FORMAT_VERSION`; or a field the schema refuses (its JSON path and why).
    """
    if not isinstance(raw, dict):
        raise FormatError(f"manifest is not a JSON object but {type(raw).__name__}")
    version = raw.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatError(f"manifest format_version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"manifest format {version} is newer than this release reads (format {FORMAT_VERSION}); upgrade mlpair"
        )
    errors = sorted(_validator().iter_errors(raw), key=lambda e: (list(e.absolute_path), e.message))
    if errors:
        first = errors[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first.absolute_path) or "(top level)"
        message = " ".join(first.message.split())
        message = message if len(message) <= 200 else message[:200] + "…"
        raise FormatError(f"manifest does not follow format {version}: {where}: {message}")
    return version
