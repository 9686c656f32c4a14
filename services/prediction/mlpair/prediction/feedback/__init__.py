"""Outcome feedback: what really happened to decided entities, stored beside the decisions and
measured against them.

- :mod:`.items`: one outcome as the domain holds it, and the checks every entry path shares
  (``RecordOutcomes``, ``mlpair outcomes-import``).
- :mod:`.store`: the ``decision_outcomes`` table of the ledger database: idempotent per decision,
  conflicting labels refused, outcomes of unknown decisions kept for a later join; the join.
- :mod:`.performance`: realised ROC AUC, precision and recall at the policy's thresholds,
  decision rates, ECE and Brier per family, model version and window.
- :mod:`.refresh`: PredictionService's periodic refresh of the ``prediction_realised_*`` gauges.
"""
