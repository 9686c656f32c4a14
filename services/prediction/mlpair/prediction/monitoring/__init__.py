"""Monitoring: drift of what is decided against the training baselines, fleet-wide distribution signals, and the shadow version's comparison."""
