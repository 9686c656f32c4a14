"""PredictionService: raw business attributes → recorded, explained decision.

Its folders are the stages a call goes through, in order (``composition.py`` builds them, and
``pipeline.py`` runs them):

1. ``intake/`` — the request read (Predict, BatchPredict, PredictColumns), its caller identified
   and held to its limit, its priority set, its items admitted (ids, repeats, family), concurrent
   Predicts merged into one batch, the answer encoded;
2. ``preparing/`` — each family's rows assembled into one guarded feature matrix, refused where
   unusable, fingerprinted: a ``Group``;
3. ``scoring/`` — cache → coalescer → resilience → InferenceService client, then calibration:
   the group's ``GroupScores``;
4. ``deciding/`` — the family's policy: thresholds, reason codes, explanations, replays:
   ``Decided`` columns;
5. ``recording/`` — the decision ledger every replica shares (one commit path, grouped), its
   relay, the CRM;
6. ``monitoring/`` — drift, fleet-wide signals, the shadow version's comparison.

After the answer: ``feedback/`` — realised outcomes fed back (RecordOutcomes, ``mlpair
outcomes-import``) and the realised figures per model version.

Beside them: ``server.py`` (the process), ``settings.py``, ``families.py`` (what each family
decides with), ``records.py`` and ``outcomes.py`` (the domain's values), ``errors.py``,
``metrics.py``, ``health.py``, ``relay_server.py`` (``mlpair relay``).
"""
