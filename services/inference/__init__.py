"""InferenceService: runs models from the repository and returns raw logits only.

Request path: ``server.py`` (wiring) → ``servicer.py`` (proto ⇄ domain, thin) →
``engine.py`` (validation, version contract, model choice) → ``runtimes/`` (ONNX Runtime).
"""
