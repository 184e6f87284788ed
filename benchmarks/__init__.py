"""Lasting benchmarks: each module prints its figures against a baseline measured in the same run,
with the machine it ran on. Run from the repository root, e.g. ``python -m benchmarks.bench_runtime``;
``python -m benchmarks.report`` (``make benchmarks``) runs the set and rewrites ``docs/benchmarks.md``.
"""
