"""Reproducible benchmarks behind ``kvxfer bench``: seeded inputs, one table, optional JSON/PNG.

Modules: :mod:`kvxfer.bench.report` (shared table / JSON / chart helpers) and one module
per benchmark (:mod:`kvxfer.bench.descriptors`). Nothing here is imported by the library.
"""
