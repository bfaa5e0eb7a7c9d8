"""Benchmarks of aiokv's hot paths, and the baselines they are measured against."""
