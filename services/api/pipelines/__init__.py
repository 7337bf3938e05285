"""The seed product's management API: the model registry, pipelines, their deployments, logs, inference URLs and publishing."""
