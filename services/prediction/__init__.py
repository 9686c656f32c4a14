"""PredictionService: raw business attributes → recorded, explained decision.

Request path: ``server.py`` (wiring) → ``servicer.py`` (proto ⇄ domain, thin) →
``pipeline.py`` (assemble features → guards → InferenceService → calibration → policy →
CRM write) with ``scoring/`` (cache → coalescer → resilience → InferenceService client),
``policy.py``, ``records.py`` (decision domain types) and ``crm/`` (SQLAlchemy) beside it.
"""
