"""Benchmarks: speed measurements with their targets (`make bench`); never part of `make test`."""
