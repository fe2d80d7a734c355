"""One-off experiments, kept but not maintained (bench/archive/README.md)."""
