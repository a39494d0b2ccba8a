"""Benchmarks and their data sets (``bench/data/``): PolicyDesk and the load tools built on it."""
