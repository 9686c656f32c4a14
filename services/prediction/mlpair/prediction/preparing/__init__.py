"""Preparing: a batch's rows checked (ids), assembled into one guarded feature matrix per family, and fingerprinted for idempotency."""
