"""Run the model on the process's main thread and the bus on an asyncio loop in another thread."""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future

POLL_S = 0.2  # how often the idle main thread looks up (signals are handled between polls)


class MainThreadExecutor(Executor):
    """The bus loop hands the forward to the main thread: torch's CPU kernels launched from another
    thread ran ~1.7x slower (each thread that starts OpenMP work gets a team of its own)."""

    def __init__(self) -> None:
        self._work: queue.Queue = queue.Queue()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._work.put((future, fn, args, kwargs))
        return future

    def run_until(self, is_done: threading.Event) -> None:
        """The main thread's loop: run submitted work until `is_done` is set."""
        while not is_done.is_set():
            try:
                future, fn, args, kwargs = self._work.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)


def run_with_bus_thread(serve: Callable[[asyncio.Event], Awaitable[None]], executor: MainThreadExecutor) -> None:
    """`serve(signalled)` runs on a loop in a background thread; the main thread runs the executor
    and turns signals into `signalled.set()` on that loop. Returns when `serve` returns."""
    ready = threading.Event()
    done = threading.Event()
    box: dict = {}

    def bus() -> None:
        async def main() -> None:
            box["loop"], box["signalled"] = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await serve(box["signalled"])

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread below
            box["error"] = exc
        finally:
            ready.set()
            done.set()

    def on_signal(signum, _frame) -> None:
        if "loop" in box:
            box["loop"].call_soon_threadsafe(box["signalled"].set)

    thread = threading.Thread(target=bus, name="bus", daemon=True)
    thread.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    ready.wait()
    executor.run_until(done)
    thread.join()
    if "error" in box:
        raise box["error"]
