"""InferenceService: runs models from the repository and returns raw logits only.

Request path: ``server.py`` (wiring, lifecycle) → ``servicer.py`` (the project's API and the
Open Inference Protocol v2, thin) → ``engine.py`` (checks, readiness) → ``batcher.py``
(dynamic batching) → ``runtimes/`` (ONNX Runtime, PyTorch); ``repository.py`` owns model
versions. See README.md beside this file.
"""
