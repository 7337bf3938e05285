"""Tokenizing and template rendering run off the event loop, in a small pool: a large or slow
request waits its turn there and never stalls the streams of others."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

PREP_THREADS = 4
_POOL = ThreadPoolExecutor(max_workers=PREP_THREADS, thread_name_prefix="api-prep")
T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args, **kwargs) -> T:
    return await asyncio.get_running_loop().run_in_executor(_POOL, partial(fn, *args, **kwargs))
