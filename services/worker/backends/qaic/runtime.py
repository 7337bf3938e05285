"""Where Qualcomm's runtime would load a compiled program and run it on Cloud AI 100 cards.

Switchyard does not drive the cards yet: it has not been run against Qualcomm's runtime (the
`qaicrt` Python module of the Cloud AI 100 Platform SDK, devices at /dev/qaic_*). The adapter is
this file alone: `detect()` says what the host has; `load()` is where a QPC built from
`QaicProgram`'s specializations and build options would be handed to `qaicrt`. Without the
runtime, the program runs on the emulator (backend.py), which says so in the worker's hello,
its logs, `/v1/models` and the pipeline status.
"""

from __future__ import annotations

from shared.config import ConfigError
from shared.control.agents import qaic_runtime


def detect() -> str | None:
    """A description of the Cloud AI 100 runtime and devices on this host, or None."""
    return qaic_runtime()


def load(program) -> None:
    """Hand a compiled program (a QaicProgram: its specializations, build options and weight image)
    to Qualcomm's runtime. Not built: see the module's docstring."""
    raise ConfigError(f"a Cloud AI 100 runtime is present ({detect()}), but Switchyard does not drive it yet, so it "
                      f"cannot run a program of {len(program.specializations)} specializations on it; set accel to "
                      "'cpu' or 'cuda', or run the QAIC emulator on a host without the cards")
