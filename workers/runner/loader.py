"""Checkpoint loading, under its former home (`workers/runner/models/weights.py`)."""

from workers.runner.models.weights import load_weights

__all__ = ["load_weights"]
