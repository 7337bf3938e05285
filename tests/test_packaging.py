"""Dependencies as users install them: pyproject's runtime dependencies cover what the services
import, the locks agree with them, the image's lock has no test tools, and `pip install .` gives a
`switchyard` command with the kernels' sources."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
TEST_TOOLS = {"pytest", "pytest-asyncio", "pytest-timeout", "import-linter", "langchain-openai", "langchain-core",
              "langgraph", "litellm", "transformers"}


def _requirements(names: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, names)}


def _lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-r"):
            package, version = line.split("==")
            assert canonicalize_name(package) not in pins, f"{name} pins {package} twice"
            pins[canonicalize_name(package)] = version
    return pins


def _imports_of(root: Path) -> dict[str, Path]:
    """Third-party top-level modules imported under root (the SDK's own `mac` and `vllm` are ours)."""
    found = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("services", "shared", "switchyard", "mac",
                                                                      "vllm", "__future__"):
                    found.setdefault(top, path)
    return found


def test_every_module_the_services_import_is_a_declared_runtime_dependency():
    runtime = _requirements(PYPROJECT["dependencies"])
    cuda = _requirements(PYPROJECT["optional-dependencies"]["cuda"])
    distributions = importlib.metadata.packages_distributions()
    for root in ("services", "shared", "switchyard"):
        for module, path in _imports_of(REPO / root).items():
            owners = {canonicalize_name(d) for d in distributions.get(module, [])}
            declared = owners & (set(runtime) | (set(cuda) if "backends/cuda" in str(path) else set()))
            assert declared, f"{path.relative_to(REPO)} imports {module} ({owners}), which pyproject does not declare"


def test_the_locks_pin_the_declared_ranges_and_the_images_lock_has_no_test_tools():
    runtime, full = _lock("requirements-runtime.txt"), _lock("requirements.txt")
    assert "-r requirements-runtime.txt" in (REPO / "requirements.txt").read_text().splitlines()
    assert not set(runtime) & set(full), "requirements.txt pins again what the runtime's lock pins"
    for name, requirement in _requirements(PYPROJECT["dependencies"]).items():
        assert requirement.specifier.contains(runtime[name]), f"{name}=={runtime[name]} is outside {requirement}"
    extras = [r for group in PYPROJECT["optional-dependencies"].values() for r in group]
    for name, requirement in _requirements(extras).items():
        locked = {**runtime, **full}[name]
        assert requirement.specifier.contains(locked), f"{name}=={locked} is outside {requirement}"
    assert not TEST_TOOLS & set(runtime) and TEST_TOOLS <= set(full)
    for name, version in {**runtime, **full}.items():  # the venv the suite runs in is the lock's
        # the first on sys.path, as an import finds it (setuptools appends its vendored copies after)
        installed = importlib.metadata.version(name)
        assert installed.split("+")[0] == version, f"{name}: locked {version}, installed {installed}"


def test_pip_install_gives_a_switchyard_command_and_the_kernels_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("switchyard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "services/worker/backends/torch_cpu/kernels/csrc/quant_linear.c" in names
    assert not any(n.startswith(("tests/", "bench/", "docs/")) for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site), "SWITCHYARD_CACHE": str(tmp_path / "cache")}
    env.pop("SY_KERNELS_DIR", None)
    usage = subprocess.run([sys.executable, str(site / "bin" / "switchyard")], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
    assert usage.returncode == 1 and "switchyard run" in usage.stderr and "build-kernels" in usage.stderr
    where = subprocess.run([sys.executable, "-c", "from services.worker.backends.torch_cpu.kernels import build; "
                            "print(build.__file__); print(build.kernels_dir())"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(site / "services/worker/backends/torch_cpu/kernels/build.py"), str(tmp_path / "cache/kernels")]
