"""Switchyard's user-facing package: the launcher behind `make run` (the SDK will live here too)."""
