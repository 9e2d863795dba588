"""Benchmarks and the GPU smoke check, run by hand; pytest does not collect them."""
