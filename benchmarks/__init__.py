"""Benchmarks and kernel checks: run as `python -m benchmarks.NAME` from the repository root."""
