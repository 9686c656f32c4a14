"""Deciding: calibrated probabilities turned into decisions by each family's policy (thresholds, reason codes), explanations, and the outcome of a request id already on record."""
