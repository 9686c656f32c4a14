"""Contracts shared by training, InferenceService and PredictionService.

Nothing here imports grpc, torch or onnxruntime: every role can load it.
"""

FEATURE_VERSION_KEY = "x-feature-version"
"""The gRPC metadata key (and OIP request parameter) that carries the caller's feature schema
version; lower case, as HTTP/2 requires of header names. InferenceService refuses a call whose
value differs from the model's feature schema version (FAILED_PRECONDITION)."""
