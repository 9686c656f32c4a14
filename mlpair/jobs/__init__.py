"""Batch-scoring jobs: a table of applicants (a Parquet or CSV file, a PostgreSQL query) decided
chunk by chunk through PredictionService's ``PredictColumns``, resumable after a crash.

- :mod:`~mlpair.jobs.chunks`: one chunk's request ids (derived from the job id and each row's key,
  so a rerun replays instead of deciding again) and its trip through the service
  (:func:`~mlpair.jobs.chunks.decide_chunk`); any engine that runs the job (this machine, or a
  distributed one over partitions) calls it.
"""
