"""mlpair: a gRPC serving pair that splits inference (raw logits) from prediction (decisions)."""
