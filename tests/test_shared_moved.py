"""The flat paths shared/ had before its packages still import and run, as the new module, with a warning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from shared.moved import MOVED, new_name


@pytest.mark.parametrize("old", sorted(f"shared.{m}" for m in MOVED))
def test_an_old_path_is_the_new_module(old):
    new = importlib.import_module(new_name(old))
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is new  # one module object: a msgspec type from either path is the same type
    assert any(issubclass(w.category, FutureWarning) and new_name(old) in str(w.message) for w in caught)


def test_the_client_library_as_the_readme_used_to_show_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from shared.client import BusClient as Old
        from shared.messages import SamplingParams as OldParams
    from shared.bus.client import BusClient
    from shared.wire.messages import SamplingParams

    assert Old is BusClient and OldParams is SamplingParams


def test_python_dash_m_at_an_old_path_runs_the_new_module():
    done = subprocess.run([sys.executable, "-m", "shared.nats_auth", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "usage: python -m shared.bus.nats_auth" in done.stdout
    assert "python -m shared.nats_auth is now python -m shared.bus.nats_auth" in done.stderr


def test_a_path_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("shared.no_such_module")


def test_what_shared_finds_beside_it_is_still_found_from_its_packages():
    """Modules that read the repository around them (the version a published pipeline carries, the
    custom runtime's SDK) look one folder further up since the move."""
    import tomllib
    from pathlib import Path

    from shared.control.pipeline_artifact import engine_version
    from shared.models.custom_environment import SDK

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] in engine_version()
    assert SDK.is_dir()
