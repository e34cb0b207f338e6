"""Benchmarks: `python -m bench` (see bench/RESULTS.md)."""
