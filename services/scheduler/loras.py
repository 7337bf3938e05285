"""A model's LoRA adapters as its workers serve them: which pools can run a request's adapter, and
the load and unload orders (API -> here -> each worker). An unloaded adapter takes no new request
at once; its workers let it go once the requests already on it have finished."""

from __future__ import annotations

import asyncio

from services.scheduler.pool import PoolLoop
from services.scheduler.request import Request
from shared.log import get_logger
from shared.wire.lora import LoraInfo, LoraOrder, LoraState, UnloadLora

log = get_logger("scheduler.loras")


class ModelLoras:
    def __init__(self) -> None:
        self.unloading: set[str] = set()  # refused to new requests; released when none runs on it

    def served(self, pools: list[PoolLoop]) -> list[LoraInfo]:
        """Every adapter some alive worker serves, once each (the first worker's word), less those unloading."""
        seen: dict[str, LoraInfo] = {}
        for pool in pools:
            for info in pool.hello.loras:
                if info.name not in self.unloading:
                    seen.setdefault(info.name, info)
        return sorted(seen.values(), key=lambda info: info.name)

    def pools_for(self, lora: str | None, pools: list[PoolLoop]) -> list[PoolLoop]:
        """The pools that can run a request on `lora` (all of them for the base model)."""
        if lora is None:
            return pools
        if lora in self.unloading:
            return []
        return [p for p in pools if any(info.name == lora for info in p.hello.loras)]

    def digest(self, lora: str, pools: list[PoolLoop]) -> str:
        """The adapter's digest as the first worker serving it announced it ("" if none says)."""
        return next((info.digest for p in pools for info in p.hello.loras if info.name == lora), "")

    async def order(self, order: LoraOrder, pools: list[PoolLoop]) -> LoraState:
        if not pools:
            return LoraState([], "no worker serves the model: an adapter is loaded on its workers")
        if isinstance(order, UnloadLora):
            if not self.pools_for(order.name, pools):
                return LoraState(self.served(pools), f"The lora adapter '{order.name}' cannot be found.", not_found=True)
            self.unloading.add(order.name)
            log.info("lora_unloading", name=order.name)
            return LoraState(self.served(pools))
        loaded = any(info.name == order.name for p in pools for info in p.hello.loras)
        if loaded and order.name not in self.unloading and not order.load_inplace:
            return LoraState(self.served(pools), f"The lora adapter '{order.name}' has already been loaded.")
        self.unloading.discard(order.name)  # loaded again before the last one let go: its workers replace it
        errors = await _order_all(order, pools)
        if errors:  # a worker refused a new adapter: the others let it go again, so every worker serves
            if not loaded:  # the same (one loaded in place before keeps serving, as a refusal leaves it)
                await _order_all(UnloadLora(order.name), pools)
            return LoraState(self.served(pools), errors[0])
        log.info("lora_loaded", name=order.name, path=order.path, num_workers=len(pools))
        return LoraState(self.served(pools))

    async def release_idle(self, pools: list[PoolLoop], in_flight: list[Request]) -> bool:
        """Unloading adapters that no request runs on any more are let go by their workers; whether any was."""
        busy = {r.lora for r in in_flight}
        idle = [name for name in self.unloading if name not in busy]
        for name in idle:
            await _order_all(UnloadLora(name), pools)
            self.unloading.discard(name)
            log.info("lora_unloaded", name=name)
        return bool(idle)


async def _order_all(order: LoraOrder, pools: list[PoolLoop]) -> list[str]:
    """The order to every pool's worker; their refusals (each pool's hello takes the adapters it says)."""
    answers = await asyncio.gather(*(pool.order_lora(order) for pool in pools), return_exceptions=True)
    errors = []
    for pool, answer in zip(pools, answers, strict=True):
        if isinstance(answer, BaseException):
            errors.append(f"worker {pool.worker_id}: {type(answer).__name__}: {answer}")
            continue
        pool.hello.loras = answer.adapters
        if answer.error:
            errors.append(answer.error)
    return errors

