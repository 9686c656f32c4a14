"""Intake: a call's request read and checked (Predict, BatchPredict, PredictColumns), concurrent Predicts merged into one batch, and the answer encoded."""
