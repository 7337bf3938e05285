"""The services' flags as the launcher reads them: checked before any service starts, and what the
CPU workers will pick for the settings left on auto."""

from __future__ import annotations

import argparse

from services.worker.backends.torch_cpu.kernels.build import why_unusable as kernels_unusable
from shared.config import (
    ConfigError,
    add_agent_args,
    add_engine_args,
    add_scheduler_args,
    add_worker_args,
    engine_config_from_args,
)
from shared.engine_defaults import pick_for_host
from shared.gateway_config import add_api_args
from shared.models.model_files import resolve_model_path


def check_service_args(service_args: list[str]) -> None:
    """Every flag meant for the services must be one some service reads, and the engine's values
    allowed: a typo or a bad value is refused here, before any service starts."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="make run ARGS=...", description="flags passed to the services")
    try:
        for add in (add_engine_args, add_worker_args, add_api_args, add_agent_args, add_scheduler_args):
            add(parser)
    except ConfigError as exc:  # an SY_* variable that is not what its flag takes
        parser.error(str(exc))
    args = parser.parse_args(service_args)  # exits with a usage message on an unknown flag
    try:
        engine_config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))


def engine_defaults_lines(service_args: list[str], fetched_path: str | None = None) -> list[str]:
    """What the CPU workers will pick for the settings left on auto, and why (the workers log the same);
    fetched_path: where the launcher put a Hub id's model."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_args(parser)
    add_worker_args(parser)
    args = parser.parse_known_args(service_args)[0]
    if args.device != "cpu":
        return []
    try:
        config = engine_config_from_args(args)
        model_path = fetched_path or resolve_model_path(config.model_path, config.revision, config.download_dir)
        defaults = pick_for_host(config, model_path, dtype=args.dtype, compile=args.compile,
                                 deterministic=args.deterministic, kernels=kernels_unusable())
    except (ConfigError, OSError) as exc:
        return [f"(the worker will refuse its settings: {exc})"]
    return defaults.lines()
