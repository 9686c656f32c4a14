"""Batch-scoring jobs (``mlpair score``): a table of applicants (a Parquet or CSV file, a PostgreSQL
query) decided chunk by chunk through PredictionService's ``PredictColumns``, resumable after a crash.

- :mod:`~mlpair.jobs.chunks`: one chunk's request ids (derived from the job id and each row's key,
  so a rerun replays instead of deciding again) and its trip through the service
  (:func:`~mlpair.jobs.chunks.decide_chunk`); any engine that runs the job (this machine, or a
  distributed one over partitions) calls it.
- :mod:`~mlpair.jobs.sources`: the input, read in chunks of a fixed number of rows;
  :mod:`~mlpair.jobs.keys`: its keys, checked whole (none null, none repeated) before anything is sent.
- :mod:`~mlpair.jobs.state`: the job's state file (chunks done, counts, rate, deadline) and ``--status``.
- :mod:`~mlpair.jobs.outputs`: per-chunk part files and the output assembled from them.
- :mod:`~mlpair.jobs.metrics`: the job's Prometheus metrics (textfile, Pushgateway).
- :mod:`~mlpair.jobs.local`: the job on this machine; :mod:`~mlpair.jobs.progress`: its progress.
"""
