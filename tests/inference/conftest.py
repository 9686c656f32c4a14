"""Fixtures for InferenceService tests live in tests/conftest.py (real holdout features, the
version contract), shared with the end-to-end tests."""
