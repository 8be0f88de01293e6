"""Benchmarks and method studies (``./launch.sh bench [MODE]``): each measures in one run and prints ratios; dated
results live in ``benchmarks/results/``."""
