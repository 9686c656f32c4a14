"""Model versions: which serve (the version policy), what a serving one holds, and each one's state.

What :mod:`mlpair.inference.repository` loads and publishes, the engine and converters read,
and the settings validate (``version_policy``); nothing here loads or runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlpair.contracts.manifest import ModelEntry
from mlpair.inference import metrics
from mlpair.inference.batcher import DynamicBatcher
from mlpair.inference.model_health import VersionHealth
from mlpair.inference.runtimes import Runtime

LOADING, READY, UNLOADING, UNAVAILABLE = "LOADING", "READY", "UNLOADING", "UNAVAILABLE"


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions serve (Triton's ``version_policy``).

    ``latest:N``: the N highest; ``all``: every version; ``specific:1,3``: exactly those.
    """

    kind: str
    count: int = 1
    versions: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        """Parses ``latest:N``, ``all`` or ``specific:a,b,...``.

        Raises:
            ValueError: any other text, naming the accepted forms.
        """
        kind, _, arg = text.strip().partition(":")
        try:
            if kind == "all" and not arg:
                return cls("all")
            if kind == "latest" and int(arg) >= 1:
                return cls("latest", count=int(arg))
            if kind == "specific":
                versions = tuple(sorted({int(v) for v in arg.split(",")}))
                if versions and versions[0] >= 1:
                    return cls("specific", versions=versions)
        except ValueError:
            pass
        raise ValueError(f"version policy {text!r}: use latest:N (N >= 1), all, or specific:1,3")

    def select(self, available: list[int]) -> list[int]:
        """The versions (ascending) of ``available`` this policy serves."""
        if self.kind == "all":
            return sorted(available)
        if self.kind == "latest":
            return sorted(available)[-self.count :]
        return [v for v in sorted(available) if v in self.versions]


@dataclass
class ServedVersion:
    """A model version that is loaded, warmed and serving through its batcher; ``health`` says
    whether it can answer now (:mod:`mlpair.inference.model_health`)."""

    entry: ModelEntry
    runtime: Runtime
    batcher: DynamicBatcher
    load_seconds: float
    health: VersionHealth
    version: str = field(init=False)
    name: str = field(init=False)

    def __post_init__(self) -> None:
        manifest = self.entry.manifest
        self.version = manifest.model_version
        self.name = manifest.model_name
        self.feature_version = manifest.versions.feature_schema_version
        self.n_features = manifest.n_features
        self.n_classes = len(manifest.class_names)
        self.input_name = manifest.inputs[0].name
        self.output_name = manifest.outputs[0].name
        self.m_duration = metrics.REQUEST_DURATION.labels(self.name, self.version)
        self.m_nonfinite = metrics.NONFINITE_OUTPUTS.labels(self.name, self.version)


@dataclass
class VersionStatus:
    """One row of the repository index."""

    name: str
    version: str
    state: str
    reason: str = ""
    source_stamp: str = ""
