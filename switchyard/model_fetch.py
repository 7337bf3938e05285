"""A Hub id in `--model-path`, downloaded once by the launcher before any service starts; the
services then read that snapshot from the cache offline, so all of them load the same files."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from shared.config import add_engine_args
from shared.models.hub import is_hub_id


class FetchFailed(RuntimeError):
    pass


def hub_model(service_args: list[str]) -> tuple[str, list[str]] | None:
    """(the Hub id, the flags that place it) when the services are to serve one; None otherwise."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_args(parser)
    args = parser.parse_known_args(service_args)[0]
    if not is_hub_id(args.model_path):
        return None
    flags = [*(["--revision", args.revision] if args.revision else []),
             *(["--download-dir", args.download_dir] if args.download_dir else [])]
    return args.model_path, flags


def fetch(model_id: str, flags: list[str], env: dict) -> str:
    """`python -m shared.models.hub` in a process of its own (huggingface_hub reads its environment at import),
    its progress passed through to this terminal; FetchFailed with its message if it stops."""
    proc = subprocess.Popen([sys.executable, "-m", "shared.models.hub", model_id, *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tail = b""
    while chunk := os.read(proc.stderr.fileno(), 4096):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        tail = (tail + chunk)[-4000:]
    path = proc.stdout.read().decode().strip()
    if proc.wait() != 0:
        lines = [line for line in tail.decode(errors="replace").splitlines() if line.startswith("error: ")]
        raise FetchFailed(lines[-1].removeprefix("error: ") if lines else f"fetching {model_id} failed")
    return path
