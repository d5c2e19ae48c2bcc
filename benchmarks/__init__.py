"""Benchmarks: scripts that print figures (never timed asserts)."""
