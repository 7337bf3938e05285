"""A custom model's Python environment: a virtual environment per artifact (by sha256), its
requirements installed from the package index, Switchyard's own packages and the runtime's sdk/
(the `mac` and `vllm` names the script imports) on its path after them. The API makes it when a
model is converted, the worker when it starts one."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from shared.models.custom_artifact import requirements_in
from shared.models.model_files import cache_root

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "services" / "custom_runtime" / "sdk"  # a path on the environment's sys.path, not an import
PIP_TIMEOUT_S = 900
READY_LINE = b"[switchyard] custom runtime ready"  # the runtime prints it once it takes predicts


def python_for(sha256: str, root: Path) -> str:
    """The environment's python, made on first use (the API's conversion, else the worker's start)."""
    platform = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    paths = [str(SDK), str(REPO), *platform]  # on its path after its own packages
    # one per artifact and per Switchyard install: another checkout's environment points elsewhere
    folder = cache_root() / "runtimes" / f"{sha256[:32]}-{hashlib.sha256(' '.join(paths).encode()).hexdigest()[:12]}"
    if (folder / ".ready").exists():
        return str(folder / "bin" / "python")
    requirements = requirements_in(root)
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(staging)], check=True, capture_output=True)
    site = Path(subprocess.run([str(staging / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    (site / "switchyard-runtime.pth").write_text("\n".join(paths) + "\n")
    if requirements:
        pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(staging / "bin" / "python"), "install",
                              "--quiet", "--disable-pip-version-check", *requirements],
                             capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        if pip.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise ValueError(f"requirements.txt: pip could not install {requirements}: "
                             f"{(pip.stderr or pip.stdout).strip()[-800:]}")
    (staging / ".ready").touch()
    try:
        staging.rename(folder)
    except OSError:  # made meanwhile by another process: theirs is as good
        shutil.rmtree(staging, ignore_errors=True)
    return str(folder / "bin" / "python")
