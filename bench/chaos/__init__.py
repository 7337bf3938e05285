"""Chaos as a tool: the stack under a steady mixed load and random faults (python -m bench.chaos)."""
