"""Switchyard's shared contract, in layers: wire/ (what travels on the bus), models/ (model files
and tokenizers), bus/ (the client library: see shared/bus/client.py), control/ (registry,
deployments, artifacts); config, checks, engine defaults and logging beside them."""

from shared import moved

moved.install()
