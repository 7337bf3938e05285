"""python -m services.custom_runtime: a custom model's own process, in its own environment. It
imports the user's script and answers predict requests on `sy.v1.custom.<deployment>.predict`."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

import msgspec

from services.custom_runtime import context
from services.custom_runtime.predictor import load_inference, predict
from shared import log as sylog
from shared.bus import close, connect
from shared.bus.client import BusClient
from shared.models.custom_environment import READY_LINE
from shared.models.tokenizer import load_tokenizer
from shared.wire import subjects

log = sylog.get_logger("custom-runtime")


async def run(args: argparse.Namespace) -> None:
    nc = await connect(args.nats_url, f"custom-{args.deployment}")
    bus = BusClient(nc)
    await bus.start()
    context.CURRENT = context.RuntimeContext(bus=bus, model=args.deployment, model_path=args.model_path,
                                             artifact_dir=args.artifact_dir, tokenizer=load_tokenizer(args.model_path))
    inference = load_inference(Path(args.artifact_dir))
    tasks: set[asyncio.Task] = set()

    async def answer(msg) -> None:
        try:
            rows = msgspec.json.decode(msg.data)["rows"]
            reply = {"rows": await predict(inference, rows)}
        except Exception as exc:  # the user's code failed this request: it says so, the runtime goes on
            log.exception("predict_failed", deployment=args.deployment)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        await msg.respond(msgspec.json.encode(reply))

    async def on_predict(msg) -> None:  # each request its own task: predicts overlap, the engine batches them
        task = asyncio.get_running_loop().create_task(answer(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    sub = await nc.subscribe(subjects.custom_predict(args.deployment), queue="custom-runtime", cb=on_predict)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    asyncio.get_running_loop().create_task(_stop_when_orphaned(stop))
    log.info("custom_runtime_ready", deployment=args.deployment, inference=type(inference).__name__)
    print(READY_LINE.decode(), flush=True)  # the worker says hello to the scheduler after this
    await stop.wait()
    await sub.unsubscribe()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)  # what was taken is answered
    await bus.stop()
    await close(nc)


async def _stop_when_orphaned(stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Its worker gone (even killed), the runtime goes too: nothing left running for no one."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(interval_s)
    stop.set()


def main() -> None:
    parser = argparse.ArgumentParser(description="a custom model's runtime")
    for flag in ("--nats-url", "--deployment", "--artifact-dir", "--model-path"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    sylog.configure("custom-runtime")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
