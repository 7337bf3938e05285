"""vLLM's sleep mode on the bus: the orders (API -> scheduler -> each worker) and their answer."""

from __future__ import annotations

from typing import Union

import msgspec


class Sleep(msgspec.Struct, tag="sleep"):
    """vLLM's sleep mode (API -> scheduler -> each worker): running requests go back to waiting, the
    workers free their weights and KV pool; requests wait until WakeUp. Levels 1 and 2 free the same
    here: a CPU worker has no device memory to offload to, and reads its weights back from the file."""

    level: int = 1


class WakeUp(msgspec.Struct, tag="wake_up"):
    pass


class SleepState(msgspec.Struct, tag="sleep_state"):
    is_sleeping: bool
    error: str | None = None  # the order could not be carried out (a worker refused or did not answer)


SLEEP_ORDER_DECODER = msgspec.msgpack.Decoder(Union[Sleep, WakeUp])
SLEEP_STATE_DECODER = msgspec.msgpack.Decoder(SleepState)

