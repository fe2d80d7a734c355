"""What the gateway exposes about itself to operators (Prometheus metrics)."""
