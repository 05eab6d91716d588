"""Benchmarks: scripts run as modules (`python -m bench.prefix_cache`) and the load generator
behind `splitserve bench` (bench/loadgen)."""
