"""Where a model name is served: the embedded engine or an OpenAI-compatible HTTP upstream."""

from gateway.deployments.base import (
    AdapterRef,
    Call,
    Deployment,
    UpstreamFailure,
    engine_adapter_name,
)
from gateway.deployments.config import DeploymentConfig, load_deployments_file
from gateway.deployments.registry import DeploymentRegistry

__all__ = [
    "AdapterRef",
    "Call",
    "Deployment",
    "DeploymentConfig",
    "DeploymentRegistry",
    "UpstreamFailure",
    "engine_adapter_name",
    "load_deployments_file",
]
