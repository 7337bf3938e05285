"""Switchyard's shared contract: wire schemas, subjects, config, hashing, logging, metrics.

Internal teams use this package as the client library for the bus (see shared/client.py).
"""
