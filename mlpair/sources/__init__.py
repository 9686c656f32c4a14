"""Where model versions come from: a local folder, S3-compatible object storage or an MLflow
model registry, chosen by URI (:func:`open_source`), and how a trained version gets there
(:mod:`mlpair.sources.publish`).

Every source answers the same questions: which models and versions it holds, and a local folder
for one version (:meth:`~mlpair.sources.base.ModelSource.fetch`). Remote versions are pinned by
content digest (:mod:`mlpair.sources.digest`), downloaded once per node into a cache keyed by it
(:mod:`mlpair.sources.cache`) and verified before anything loads from them.
"""

from mlpair.sources.base import ModelSource, SourceUnavailable, open_source, redact
from mlpair.sources.digest import VersionRefused

__all__ = ["ModelSource", "SourceUnavailable", "VersionRefused", "open_source", "redact"]
