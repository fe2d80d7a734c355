"""A deployment's settings, from the YAML file or the admin API. The upstream key stays here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from billing.pricing import Rates, charge

# "worker": a remote Switchboard worker; "openai": any OpenAI-compatible HTTP upstream. Both
# take the direct pooled HTTP path. "litellm": any provider litellm knows, through litellm.
Provider = Literal["embedded", "worker", "openai", "litellm"]
HTTP_PROVIDERS = ("worker", "openai")
# APIs besides chat completions that a client may speak to the gateway and an upstream may
# serve as they are: OpenAI's Responses (`/responses`) and Anthropic's Messages (`/messages`).
NativeApi = Literal["responses", "messages"]
# What a litellm provider speaks natively when the config does not say: Anthropic's API is
# Messages wherever it is pointed; OpenAI serves Responses at its own endpoint (with a
# base_url, an OpenAI-compatible server elsewhere may not, so the config must say).
LITELLM_NATIVE_APIS: dict[str, tuple[NativeApi, ...]] = {"anthropic": ("messages",),
                                                         "openai": ("responses",)}
LITELLM_NATIVE_AT_OWN_ENDPOINT_ONLY = frozenset({"openai"})
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/@-]+$")]


class Capabilities(BaseModel):
    """What a deployment can do with a request's optional features. Routing sends a request
    only where every feature it uses is supported; where none is, the client gets a 400
    naming the field (`gateway.features`). Defaults describe an OpenAI-compatible upstream;
    the embedded engine reports its own (`EmbeddedDeployment`)."""

    model_config = ConfigDict(extra="forbid")

    adapters: bool = False  # serves tenants' LoRA adapters (the embedded engine with LoRA on)
    logprobs: bool = True
    tools: bool = True  # tools, tool_choice, tool messages and assistant tool_calls
    json_schema: bool = True  # response_format json_object / json_schema
    images: bool = False  # image_url / input_image content parts
    audio: bool = False  # input_audio content parts
    files: bool = False  # file content parts
    logit_bias: bool = True


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    model_name: Annotated[str, Field(min_length=1, max_length=512)]  # what clients ask for
    provider: Provider
    # "chat": /v1/chat/completions and /v1/completions; "embedding": /v1/embeddings only.
    mode: Literal["chat", "embedding"] = "chat"
    # The upstream's model: a path or "default" (embedded), the worker's model name, or a
    # litellm model string such as "openai/gpt-4o-mini".
    upstream_model: str | None = None
    base_url: str | None = None
    api_key: SecretStr | None = None
    api_key_env: str | None = None
    tier: Annotated[str, Field(min_length=1, max_length=64)] = "standard"
    # USD per million tokens. None: litellm's cost map for litellm deployments, else free.
    input_price_per_1m: Annotated[Decimal, Field(ge=0)] | None = None
    output_price_per_1m: Annotated[Decimal, Field(ge=0)] | None = None
    # Prompt tokens served from the prefix cache. None: half the input price.
    cached_input_price_per_1m: Annotated[Decimal, Field(ge=0)] | None = None
    context_window: Annotated[int, Field(ge=1)] = 8192
    capabilities: Capabilities = Field(default_factory=Capabilities)
    # Request fields outside OpenAI's schema (vendor extras) that this deployment forwards as
    # sent; any other unknown field is a 400. Never applies to the embedded engine.
    passthrough_fields: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]],
                                  Field(max_length=64)] = Field(default_factory=list)
    weight: Annotated[int, Field(ge=1, le=1000)] = 1  # share among equally good deployments
    max_concurrency: Annotated[int, Field(ge=1)] | None = None  # in flight, per replica
    timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # Embedding deployments: the most input tokens one request may embed, all its inputs
    # together ([CLS]/[SEP] included); a larger request is a 400 `embedding_work_exceeded`
    # before any work. None: the gateway's `embedding_max_request_tokens` for a model in this
    # process, no bound for an upstream (checked on the estimate where set).
    max_request_tokens: Annotated[int, Field(ge=1)] | None = None
    # The APIs besides chat completions this upstream serves as they are: a request on that
    # surface is sent there natively (`gateway.deployments.native`), any other is translated
    # to chat. None: its provider's defaults (`native`); `openai` and `litellm` only.
    native_apis: Annotated[list[NativeApi], Field(max_length=2)] | None = None
    # HTTP upstreams: ask for a stream even when the client wants a whole answer (folded
    # here), so the answer's first event ends the routing deadline and a long answer is never
    # cut by it. Remote workers always do.
    stream_whole_answers: bool = False
    # Prefix-cache KV is private to each tenant unless an admin shares it on purpose (say, a
    # deployment whose public system prompt every tenant sends).
    shared_prefix_cache: bool = False
    # How our engine reads tool calls out of this model's text (embedded only; a remote
    # worker has its own `--tool-call-parser`): hermes | llama3_json.
    tool_call_parser: Literal["hermes", "llama3_json"] = "hermes"
    # A worker pool: every `switchboard worker` that registers in Redis serving this entry's
    # upstream model becomes a deployment named `<name>@<worker id>`, priced as this one.
    discover: bool = False
    # Prefix-aware routing between workers: the workers' tokenizer (a model folder or hub
    # name the gateway can read). With it the gateway names a request's prompt blocks as the
    # engines do and prefers the worker whose prefix cache holds the longest run of them,
    # less `prefix_load_penalty_tokens` per unit of load (docs/gateway.md).
    prefix_tokenizer: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    prefix_load_penalty_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 256

    @model_validator(mode="after")
    def _check(self) -> DeploymentConfig:
        if self.discover:
            if self.provider != "worker" or self.base_url:
                raise ValueError(f"deployment {self.name!r}: discover is for worker providers "
                                 "without a base_url")
        elif self.provider in HTTP_PROVIDERS and not self.base_url:
            raise ValueError(f"deployment {self.name!r}: a {self.provider} provider needs "
                             "base_url")
        if self.native_apis and (self.provider not in ("openai", "litellm")
                                 or self.mode != "chat"):
            raise ValueError(f"deployment {self.name!r}: native_apis is for chat deployments "
                             "of an openai or litellm provider (the engine and workers are "
                             "sent chat completions)")
        if self.provider == "litellm" and not self.upstream_model:
            raise ValueError(f"deployment {self.name!r}: a litellm provider needs "
                             "upstream_model, e.g. 'openai/gpt-4o-mini'")
        return self

    def native(self, litellm_provider: str | None = None) -> frozenset[NativeApi]:
        """The native APIs this deployment's upstream speaks: the config's `native_apis`, else
        the defaults of its litellm provider (`LITELLM_NATIVE_APIS`); none for any other."""
        if self.native_apis is not None:
            return frozenset(self.native_apis)
        if self.provider != "litellm" or litellm_provider is None:
            return frozenset()
        if self.base_url and litellm_provider in LITELLM_NATIVE_AT_OWN_ENDPOINT_ONLY:
            return frozenset()
        return frozenset(LITELLM_NATIVE_APIS.get(litellm_provider, ()))

    def secret(self) -> str | None:
        """The server-side upstream key: inline, or read from the named environment variable."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            return os.environ.get(self.api_key_env)
        return None

    def configured_price(self) -> Price | None:
        """The price set in the config, or None where the provider's price list decides."""
        if self.input_price_per_1m is None and self.output_price_per_1m is None:
            return None
        return Price(self.input_price_per_1m or Decimal(0),
                     self.output_price_per_1m or Decimal(0), self.cached_input_price_per_1m)

    def public(self) -> dict[str, object]:
        """What the admin API shows: everything but the secret."""
        data = self.model_dump(mode="json", exclude={"api_key"})
        data["has_api_key"] = self.api_key is not None or bool(self.api_key_env)
        return data


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens, which is exactly micro-USD per token."""

    input_per_1m: Decimal = Decimal(0)
    output_per_1m: Decimal = Decimal(0)
    cached_input_per_1m: Decimal | None = None  # None: half the input price
    source: str = "config"  # "config", "litellm" (its cost map) or "none"
    price_id: str | None = None  # its version in the price book, once recorded

    @property
    def cached_per_1m(self) -> Decimal:
        if self.cached_input_per_1m is not None:
            return self.cached_input_per_1m
        return self.input_per_1m / 2

    def rates(self) -> Rates:
        return Rates(self.input_per_1m, self.output_per_1m, self.cached_per_1m, self.price_id)

    def cost_micros(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Cost in integer micro-USD, rounded up (no cached tokens, no markup)."""
        return charge(self.rates(), prompt_tokens=prompt_tokens,
                      completion_tokens=completion_tokens).total_micros

    @property
    def per_1m(self) -> Decimal:
        """One number to rank deployments by cost: input plus output per 1M tokens."""
        return self.input_per_1m + self.output_per_1m


class AliasConfig(BaseModel):
    """A virtual model: deployments tried in order ("ordered") or cheapest first ("cost")."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    deployments: Annotated[list[Name], Field(min_length=1)]
    policy: Literal["ordered", "cost"] = "ordered"


class RoutingFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployments: list[DeploymentConfig] = Field(default_factory=list)
    aliases: list[AliasConfig] = Field(default_factory=list)


def load_routing_file(path: Path) -> RoutingFile:
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping with 'deployments' (and 'aliases')")
    return RoutingFile.model_validate(raw)


def load_deployments_file(path: Path) -> list[DeploymentConfig]:
    return load_routing_file(path).deployments
