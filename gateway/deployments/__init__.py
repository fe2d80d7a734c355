"""Where a model name is served: the embedded engine or an OpenAI-compatible HTTP upstream."""

from gateway.deployments.base import Call, Deployment, UpstreamFailure
from gateway.deployments.config import DeploymentConfig, load_deployments_file
from gateway.deployments.registry import DeploymentRegistry

__all__ = [
    "Call",
    "Deployment",
    "DeploymentConfig",
    "DeploymentRegistry",
    "UpstreamFailure",
    "load_deployments_file",
]
