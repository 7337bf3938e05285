"""A worker's adapters: the ones it serves (by name), those held in host memory (an LRU of
--max-cpu-loras), and the --max-loras slots a step computes with (an LRU too: an adapter a step
needs takes the slot least recently used by another)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.worker.lora.adapter import TARGETS, LoraAdapter, LoraError, load_adapter
from services.worker.lora.layers import LoraLinear, LoraRows, LoraState
from services.worker.model_config import ModelConfig
from shared.log import get_logger
from shared.wire.lora import LoraInfo

log = get_logger("worker.lora")


@dataclass(frozen=True)
class LoraLimits:
    max_loras: int = 4  # adapters one step can mix (the slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras (vLLM's default)

    @property
    def num_cpu(self) -> int:
        return self.max_cpu_loras or self.max_loras


class LoraManager:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, limits: LoraLimits):
        self.cfg, self.limits = cfg, limits
        self.served: dict[str, LoraInfo] = {}  # every adapter this worker serves
        self.cpu: OrderedDict[str, LoraAdapter] = OrderedDict()  # in host memory, least recent first
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.state = LoraState()
        self.attach_to(model)

    def attach_to(self, model: torch.nn.Module) -> None:
        """Wrap `model`'s Linears (a backend built again after sleep mode's wake too): its slots start empty."""
        self.layers = attach(model, self.cfg, self.limits, self.state)
        self.slots.clear()
        model.lora = self.state

    def add(self, name: str, path: str) -> LoraAdapter:
        """Load and check an adapter (LoraError: it does not fit this model); it is served from now on."""
        adapter = load_adapter(name, path, self.cfg, self.limits.max_lora_rank)
        if name in self.slots:  # loaded again in place: its slot takes the new weights
            self._fill(self.slots[name], adapter)
        self.served[name] = LoraInfo(name, path, adapter.rank, adapter.digest)
        self._keep(adapter)
        log.info("lora_loaded", name=name, path=path, rank=adapter.rank, mbytes=round(adapter.num_bytes / 2**20, 2))
        return adapter

    def remove(self, name: str) -> None:
        self.served.pop(name, None)
        self.cpu.pop(name, None)
        self.slots.pop(name, None)
        log.info("lora_unloaded", name=name)

    @property
    def infos(self) -> list[LoraInfo]:
        return list(self.served.values())

    def activate(self, adapters: list[str | None], tokens_per_row: list[int], device: torch.device) -> None:
        """The step's rows (their adapters, in batch order) are set on the model's LoRA Linears;
        every adapter the step uses takes a slot first."""
        needed = {a for a in adapters if a is not None}
        if len(needed) > self.limits.max_loras:
            raise LoraError(f"a step of {len(needed)} adapters is over --max-loras {self.limits.max_loras}")
        for name in needed:
            self._slot_for(name, needed)
        self.state.rows = LoraRows.of([-1 if a is None else self.slots[a] for a in adapters], tokens_per_row, device)

    def deactivate(self) -> None:
        self.state.rows = None

    def _slot_for(self, name: str, needed: set[str]) -> int:
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        if name not in self.served:
            raise LoraError(f"LoRA adapter {name!r} is not loaded on this worker")
        taken = set(self.slots.values())
        free = [s for s in range(self.limits.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used adapter that this step does not need gives up its slot
            victim = next(n for n in self.slots if n not in needed)
            slot = self.slots.pop(victim)
        adapter = self.cpu.get(name) or self._keep(load_adapter(name, self.served[name].path, self.cfg,
                                                                 self.limits.max_lora_rank))
        self.cpu.move_to_end(name)
        self._fill(slot, adapter)
        self.slots[name] = slot
        return slot

    def _keep(self, adapter: LoraAdapter) -> LoraAdapter:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        while len(self.cpu) > self.limits.num_cpu:  # evicted from host memory: read again from its files
            self.cpu.popitem(last=False)
        return adapter

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        for (layer, attr), linear in self.layers.items():
            modules = [m for m, (target, _) in TARGETS.items() if target == attr]
            linear.set_slot(slot, [(*adapter.weights[(layer, m)], adapter.scaling)
                                   if (layer, m) in adapter.weights else None for m in modules])


def attach(model: torch.nn.Module, cfg: ModelConfig, limits: LoraLimits,
           state: LoraState) -> dict[tuple[int, str], LoraLinear]:
    """Every decoder layer's wqkv, wo, w13 and w2 (a dense MLP's) wrapped with LoRA slots."""
    dtype = model.norm.weight.dtype  # the embedding may be a file's blocks (QuantEmbedding)
    device = model.norm.weight.device
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"wqkv": (cfg.hidden_size, [q, kv, kv]), "wo": (q, [cfg.hidden_size]),
              "w13": (cfg.hidden_size, [cfg.intermediate_size] * 2), "w2": (cfg.intermediate_size, [cfg.hidden_size])}
    wrapped = {}
    for i, layer in enumerate(model.layers):
        for attr, owner in [("wqkv", layer.attention), ("wo", layer.attention), ("w13", layer.feed_forward),
                            ("w2", layer.feed_forward)]:
            if not hasattr(owner, attr):
                continue  # routed experts: no dense MLP
            fan_in, out_sizes = shapes[attr]
            linear = LoraLinear(getattr(owner, attr), fan_in, out_sizes, limits.max_loras, limits.max_lora_rank,
                                dtype, device, state, layer.attention.ops)
            setattr(owner, attr, linear)
            wrapped[(i, attr)] = linear
    return wrapped
