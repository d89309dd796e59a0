"""Benchmarks run by `quarl bench ...` (GPU). Each prints a table and appends a dated entry to bench/results/."""
