"""A custom model's worker starts its runtime process (in the model's environment, as the NATS
user `custom` and no other), restarts it if it dies, and stops it when the worker stops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from shared.bus import nats_auth
from shared.log import get_logger
from shared.models.custom_environment import READY_LINE

log = get_logger("worker")
RESTART_S = 2.0
STOP_GRACE_S = 30.0


def runtime_env(folder: Path) -> dict[str, str]:
    """The worker's environment less PYTHONPATH (the model's own packages come first), and only
    the `custom` user's password: the user's code never sees another service's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    login = nats_auth.credentials("custom") if os.environ.get("SY_NATS_AUTH_FILE") else None
    if login is not None:
        users = folder / nats_auth.USERS_FILE
        users.write_text("")
        users.chmod(0o600)
        users.write_text(json.dumps({login[0]: login[1]}))
        env |= nats_auth.env_for("custom", folder)
    return env


async def supervise(python: str, argv: list[str], stopping: asyncio.Event, ready: asyncio.Event) -> None:
    """`ready` is set once the runtime first takes predicts (the worker says hello only then)."""
    with tempfile.TemporaryDirectory(prefix="switchyard-runtime-") as folder:
        env = runtime_env(Path(folder))
        while not stopping.is_set():
            proc = await asyncio.create_subprocess_exec(python, "-m", "services.custom_runtime", *argv, env=env,
                                                        stdout=asyncio.subprocess.PIPE)
            asyncio.ensure_future(_relay(proc.stdout, ready))
            exited = asyncio.ensure_future(proc.wait())
            stop = asyncio.ensure_future(stopping.wait())
            await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.is_set():
                exited.cancel()
                await _stop(proc)
                return
            stop.cancel()
            if not ready.is_set():  # the script cannot start: the worker fails with the reason, no loop
                raise RuntimeError(f"the custom runtime exited with {proc.returncode} before it was ready "
                                   "(its traceback is in the worker's log)")
            log.warning("custom_runtime_exited", returncode=proc.returncode, restart_in_s=RESTART_S)
            await asyncio.sleep(RESTART_S)


async def _relay(stdout: asyncio.StreamReader, ready: asyncio.Event) -> None:
    """The runtime's stdout (the user's prints) to the worker's; its ready line sets `ready`."""
    while line := await stdout.readline():
        if line.rstrip() == READY_LINE:
            ready.set()
        else:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)  # it answers what it took, then exits
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
