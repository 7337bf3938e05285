"""The control plane: the model registry and deployments in JetStream, the seed product's
configuration objects, host placement, and pipelines as OCI artifacts."""
