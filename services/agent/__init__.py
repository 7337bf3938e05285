"""The worker agent: one per host, it runs the worker processes the deployed pipelines ask for."""
