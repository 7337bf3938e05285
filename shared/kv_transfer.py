"""--kv-transfer-config: vLLM's JSON keys for disaggregated prefill, typed and checked once."""

from __future__ import annotations

import msgspec

from shared.checks import ConfigError, json_object, struct_of

# ours: a prefill worker's blocks reach a decode worker through the host KV tier's shared memory
CONNECTORS = ("SharedMemoryConnector",)
# vLLM's, known by name and refused with what to use instead
CONNECTORS_NOT_BUILT = ("NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1", "MooncakeConnector",
                        "SharedStorageConnector", "OffloadingConnector", "MultiConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's keys that configure a network transport this connector does not have
TRANSPORT_KEYS = ("kv_ip", "kv_port", "kv_rank", "kv_parallel_size", "kv_buffer_size", "kv_buffer_device",
                  "engine_id", "kv_connector_module_path", "kv_connector_extra_config", "kv_load_failure_policy")


class KvTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kv_connector: str = CONNECTORS[0]
    # kv_producer: computes prompts and hands each request on at its first token; kv_consumer:
    # decodes what producers hand on (takes new requests only while no producer is alive); kv_both: either
    kv_role: str = "kv_both"

    def validate(self) -> KvTransferConfig:
        if self.kv_connector in CONNECTORS_NOT_BUILT:
            raise ConfigError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is vLLM's and not built here; "
                              f"use {CONNECTORS[0]!r} (prefill and decode workers on one host, docs/kv_offloading.md)")
        if self.kv_connector not in CONNECTORS:
            raise ConfigError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is not one of {list(CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ConfigError(f"kv_transfer_config: kv_role {self.kv_role!r} is not one of {list(ROLES)}")
        return self


def parse_kv_transfer_config(value: str | dict | KvTransferConfig | None) -> KvTransferConfig | None:
    """A flag's JSON text, a dict or None -> a validated config (None: no disaggregation)."""
    if value is None or value == "" or isinstance(value, KvTransferConfig):
        return value.validate() if isinstance(value, KvTransferConfig) else None
    value = json_object("kv_transfer_config", value,
                        "{\"kv_connector\": \"SharedMemoryConnector\", \"kv_role\": \"kv_producer\"}")
    transport = sorted(set(value) & set(TRANSPORT_KEYS))
    if transport:
        raise ConfigError(f"kv_transfer_config: {', '.join(transport)} configure a network transport; "
                          f"{CONNECTORS[0]} moves blocks through host shared memory and takes kv_connector "
                          "and kv_role only")
    return struct_of("kv_transfer_config", value, KvTransferConfig).validate()
