"""Helpers the benchmarks share: machine facts, timing, workloads, model folders, the engine
benchmark's runners and report, peers, gateway processes, the mock upstream and the load
generator (bench/README.md)."""
