"""Training: real data → feature preprocessing → PyTorch model → ONNX → model repository entry."""
