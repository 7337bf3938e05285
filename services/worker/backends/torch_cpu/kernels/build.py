"""`python -m services.worker.backends.torch_cpu.kernels.build`: the CPU kernels' library, built once
(`make install`, the image's builder stage), never at a worker's start.

Each C source in csrc/ is compiled once per instruction-set variant (VARIANTS), each C++ one (the
ops' bindings) once against torch's headers, and all of it linked into one library that registers
the kernels as torch ops and picks the variant this CPU runs when it loads (bindings.cpp).
manifest.json beside it keys the build by the compilers' versions, torch's, every source and every
flag: a build whose key matches is kept, any other is built again.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent
CSRC = HERE / "csrc"
REPO = HERE.parents[4]
LIBRARY = "libswitchyard_cpu.so"
MANIFEST = "manifest.json"
KEEP_BUILDS = 4  # earlier builds kept in builds_dir() (about 4 MB each)
# x86-64's microarchitecture levels: v4 is AVX-512 (F, BW, CD, DQ, VL), v3 AVX2 with FMA and F16C;
# the portable build runs on any x86-64. avx512_vnni: v4 with VNNI's u8 x s8 dot products (Ice Lake,
# Sapphire Rapids, Zen 4 on: quant_dot.c's int8 rows). Elsewhere (aarch64) the portable build alone.
X86_VARIANTS = {"avx512_vnni": ["-march=x86-64-v4", "-mavx512vnni"], "avx512": ["-march=x86-64-v4"],
                "avx2": ["-march=x86-64-v3"], "portable": ["-march=x86-64"]}
OTHER_VARIANTS = {"portable": []}
C_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-std=gnu11", "-Wall"]
# fast-math lets the compiler reorder a row's sums into vector lanes (each row's arithmetic is still
# fixed whatever the batch); infinities stay, the softmax starts from -inf. quant_linear.c keeps
# its sums in order (its header says why).
SOURCE_FLAGS = {"decode_attention.c": ["-ffast-math", "-fno-finite-math-only"],
                "fused_ops.c": ["-ffast-math", "-fno-finite-math-only"],
                "lora.c": ["-ffast-math", "-fno-finite-math-only"]}


def kernels_dir() -> Path:
    """Where the library is built and found: SY_KERNELS_DIR, else build/kernels in a checkout, else
    (a package installed with pip) kernels/ in Switchyard's cache."""
    if "SY_KERNELS_DIR" in os.environ:
        return Path(os.environ["SY_KERNELS_DIR"])
    if (REPO / "pyproject.toml").is_file():
        return REPO / "build" / "kernels"
    return Path(os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard")) / "kernels"


def variants() -> dict[str, list[str]]:
    return X86_VARIANTS if platform.machine() in ("x86_64", "AMD64") else OTHER_VARIANTS


def sources_digest() -> str:
    """Every source's name and bytes: what a library must have been built from to be loaded."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _torch_build() -> dict:
    import torch
    from torch.utils import cpp_extension

    return {"torch": torch.__version__, "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
            "include": cpp_extension.include_paths(), "lib": cpp_extension.library_paths()[0]}


def _compilers() -> dict[str, str]:
    found = {}
    for role, default in (("CC", "cc"), ("CXX", "c++")):
        path = shutil.which(os.environ.get(role, default))
        if path is None:
            raise FileNotFoundError(f"no {role} compiler ({default}) on PATH")
        version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
        found[role] = path
        found[f"{role}_version"] = version.splitlines()[0]
    return found


def _plan(compilers: dict, torch_build: dict, out: Path) -> tuple[list[list[str]], list[str]]:
    """The compile commands (objects into `out`) and the link command's objects."""
    commands, objects = [], []
    for name, flags in variants().items():
        for source in sorted(CSRC.glob("*.c")):
            obj = str(out / f"{source.stem}-{name}.o")
            commands.append([compilers["CC"], *C_FLAGS, *flags, *SOURCE_FLAGS.get(source.name, []),
                             f"-DSY_VARIANT={name}", "-c", str(source), "-o", obj])
            objects.append(obj)
    for source in sorted(CSRC.glob("*.cpp")):  # the ops' bindings, against torch's headers
        obj = str(out / f"{source.stem}.o")
        commands.append([compilers["CXX"], "-O2", "-fPIC", "-std=c++17", "-Wall",
                         f"-D_GLIBCXX_USE_CXX11_ABI={torch_build['cxx11_abi']}",
                         *[f"-I{path}" for path in torch_build["include"]], "-c", str(source), "-o", obj])
        objects.append(obj)
    return commands, objects


def build_key(compilers: dict, torch_build: dict) -> str:
    commands, _ = _plan(compilers, torch_build, Path("."))
    text = json.dumps([compilers, torch_build["torch"], torch_build["cxx11_abi"], commands, sources_digest()])
    # the checkout's own path (its sources, its .venv's torch headers) is not part of what is built
    return hashlib.sha256(text.replace(str(REPO), "<checkout>").encode()).hexdigest()


def read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def why_unusable(directory: Path | None = None) -> str | None:
    """None where `directory` (kernels_dir()) holds a library built from these sources for the installed
    torch, else why it does not (without importing torch: the launcher asks too)."""
    directory = directory or kernels_dir()
    manifest = read_manifest(directory)
    if manifest is None or not (directory / LIBRARY).exists():
        return "the C kernels are not built (make install builds them)"
    if manifest.get("sources") != sources_digest():
        return "the C kernels were built from other sources (make install rebuilds them)"
    installed = importlib.metadata.version("torch")
    if manifest.get("torch") != installed:
        return f"the C kernels were built for torch {manifest.get('torch')}, not {installed} (make install rebuilds them)"
    return None


def builds_dir() -> Path:
    """Earlier builds by their key (as ccache keeps objects): a new checkout of the same sources, for the
    same compilers and torch, takes its library from there instead of compiling it again."""
    return Path(os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard")) / "kernel-builds"


def _copy_build(source: Path, directory: Path) -> None:
    """source's library and manifest into `directory`, each renamed in whole."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in (LIBRARY, MANIFEST):
        with tempfile.NamedTemporaryFile(dir=directory, delete=False) as tmp:
            shutil.copyfile(source / name, tmp.name)
        os.chmod(tmp.name, 0o755 if name == LIBRARY else 0o644)
        os.replace(tmp.name, directory / name)


def _keep_build(directory: Path, key: str) -> None:
    """The build just made, kept by its key; the KEEP_BUILDS newest kept, the others removed."""
    try:
        _copy_build(directory, builds_dir() / key)
        os.utime(builds_dir() / key)  # the newest kept
        kept = sorted(builds_dir().iterdir(), key=lambda path: path.stat().st_mtime_ns, reverse=True)
        for old in kept[KEEP_BUILDS:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:  # a read-only or full home: the next checkout compiles again
        pass


def build(directory: Path | None = None, force: bool = False) -> tuple[Path, str]:
    """The library in `directory` (kernels_dir()), built unless an up-to-date one is there or kept from an
    earlier build of the same key; returns its path and "up to date", "from the build cache" or "built"."""
    directory = directory or kernels_dir()
    compilers, torch_build = _compilers(), _torch_build()
    key = build_key(compilers, torch_build)
    manifest = read_manifest(directory)
    if not force and manifest and manifest.get("key") == key and (directory / LIBRARY).exists():
        return directory / LIBRARY, "up to date"
    kept = builds_dir() / key
    if not force and (read_manifest(kept) or {}).get("key") == key and (kept / LIBRARY).exists():
        _copy_build(kept, directory)
        return directory / LIBRARY, "from the build cache"
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # built aside, renamed in: never half a library
        out = Path(tmp)
        commands, objects = _plan(compilers, torch_build, out)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for result in pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands):
                if result.returncode:
                    raise RuntimeError(f"{' '.join(result.args)}\n{result.stderr}")
        library = out / LIBRARY
        link = [compilers["CXX"], "-shared", *objects, "-o", str(library), f"-L{torch_build['lib']}",
                "-lc10", "-ltorch_cpu", "-ltorch", "-fopenmp"]
        subprocess.run(link, capture_output=True, text=True, check=True)
        library.replace(directory / LIBRARY)
    # the installed distribution's version, as why_unusable reads it (a CUDA build's torch.__version__
    # carries "+cu130" where its metadata may not)
    manifest = {"key": key, "sources": sources_digest(), "torch": importlib.metadata.version("torch"),
                "compilers": {k: v for k, v in compilers.items() if k.endswith("_version")},
                "variants": list(variants()), "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _keep_build(directory, key)
    return directory / LIBRARY, "built"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: SY_KERNELS_DIR, build/kernels in a checkout, else the cache)")
    parser.add_argument("--force", action="store_true", help="build even if an up-to-date library is there")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        library, how = build(args.dir, args.force)
    except (RuntimeError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        sys.exit(f"CPU kernels: build failed: {detail}")
    what = f"built in {time.monotonic() - started:.0f} s" if how == "built" else how
    print(f"CPU kernels ({', '.join(variants())}): {what}: {library}")


if __name__ == "__main__":
    main()
