"""`from switchyard.deployment_config import DeploymentConfigBuilder`: replicas and resources."""

from switchyard.config import DeploymentConfig, DeploymentConfigBuilder

__all__ = ["DeploymentConfig", "DeploymentConfigBuilder"]
