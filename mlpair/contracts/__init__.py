"""Contracts shared by training, InferenceService and PredictionService.

Nothing here imports grpc, torch or onnxruntime: every role can load it.
"""
