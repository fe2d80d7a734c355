"""Shared checks for the deployment artefacts (no Docker engine or cluster here: parse them)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gateway.cli import _worker_arguments
from gateway.settings import Settings

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "workers", "tenancy", "caching", "billing")


def settings_env_names() -> set[str]:
    """Every Settings field's variable, and SWITCHBOARD_<FIELD>__<NAME> for the fields of a
    nested one (the embedded engine's)."""
    names = set()
    for name, field in Settings.model_fields.items():
        names.add(f"SWITCHBOARD_{name.upper()}")
        nested = getattr(field.annotation, "model_fields", None)
        if isinstance(nested, dict):
            names |= {f"SWITCHBOARD_{name.upper()}__{inner.upper()}" for inner in nested}
    return names


def source_env_names() -> set[str]:
    """SWITCHBOARD_* names that the packages read directly (not through Settings), e.g.
    SWITCHBOARD_CACHE_DIR in workers/model_files.py."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r"[\"'](SWITCHBOARD_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def unknown_env_names(names: set[str]) -> set[str]:
    """The SWITCHBOARD_* names in `names` that nothing in the project reads."""
    ours = {name for name in names if name.startswith("SWITCHBOARD_")}
    return ours - settings_env_names() - source_env_names()


def parse_worker_args(argv: list[str]) -> argparse.Namespace:
    """`switchboard worker ...` arguments through the real CLI's worker options."""
    parser = argparse.ArgumentParser(prog="switchboard worker", exit_on_error=False)
    _worker_arguments(parser)
    return parser.parse_args(argv)
