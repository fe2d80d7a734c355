"""A deployment's settings, from the YAML file or the admin API. The upstream key stays here."""

from __future__ import annotations

import math
import os
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=128)]
    model_name: Annotated[str, Field(min_length=1, max_length=512)]  # what clients ask for
    provider: Literal["embedded", "openai"]
    upstream_model: str | None = None
    base_url: str | None = None
    api_key: SecretStr | None = None
    api_key_env: str | None = None
    tier: str = "standard"
    input_price_per_1m: Decimal = Decimal(0)  # USD per million tokens
    output_price_per_1m: Decimal = Decimal(0)
    context_window: Annotated[int, Field(ge=1)] = 8192
    timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # Prefix-cache KV is private to each tenant unless an admin shares it on purpose (say, a
    # deployment whose public system prompt every tenant sends).
    shared_prefix_cache: bool = False

    @model_validator(mode="after")
    def _check(self) -> DeploymentConfig:
        if self.provider == "openai" and not self.base_url:
            raise ValueError(f"deployment {self.name!r}: an openai provider needs base_url")
        return self

    def secret(self) -> str | None:
        """The server-side upstream key: inline, or read from the named environment variable."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            return os.environ.get(self.api_key_env)
        return None

    def cost_micros(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Cost in integer micro-USD, rounded up: a price per 1M tokens is micro-USD per token."""
        exact = self.input_price_per_1m * prompt_tokens + self.output_price_per_1m * (
            completion_tokens)
        return math.ceil(exact)

    def public(self) -> dict[str, object]:
        """What the admin API shows: everything but the secret."""
        data = self.model_dump(mode="json", exclude={"api_key"})
        data["has_api_key"] = self.api_key is not None or bool(self.api_key_env)
        return data


def load_deployments_file(path: Path) -> list[DeploymentConfig]:
    raw = yaml.safe_load(path.read_text()) or {}
    items = raw.get("deployments", []) if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a mapping with a 'deployments' list")
    return [DeploymentConfig.model_validate(item) for item in items]
