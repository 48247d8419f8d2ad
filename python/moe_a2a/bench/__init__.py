"""Benchmarks run under mpirun: `moe-a2a bench fabric`, `moe-a2a bench a2a`."""
