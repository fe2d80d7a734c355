"""Helpers the benchmarks share: machine facts, timing, workloads, peers, gateway processes,
the mock upstream and the load generator (bench/README.md)."""
