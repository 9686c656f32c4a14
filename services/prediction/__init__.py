"""PredictionService: raw business attributes → recorded, explained decision.

Request path: ``server.py`` (wiring) → ``servicer.py`` (proto ⇄ domain, thin) →
``pipeline.py`` (assemble features → guards → InferenceService → calibration → policy →
CRM write) with ``inference_client.py``, ``policy.py`` and ``crm/`` beside it.
"""
