"""Benchmarks of aiokv's hot paths and the baselines they are measured against.

They live in the repository, not in the installed ``aiokv`` package: run them from a checkout's root as
``python -m benchmarks [SUITE] [options]`` (``--help`` lists the suites).
"""
