"""The C kernels' library: built once by `make install` (never by a worker), keyed by the compilers,
torch and every source (a new checkout of the same key takes an earlier build's), its variant chosen
for the CPU at load, and a stale build refused by name."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import pytest
import torch

from services.worker.backends.torch_cpu.kernels import build
from shared.cpu_features import host_cpu_flags

# what x86-64's levels need (the kernel's own check is the compiler's __builtin_cpu_supports)
LEVEL_FLAGS = {"avx512_vnni": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx2"},
               "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c"},
               "avx2": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}}


def test_a_build_is_kept_while_its_key_holds_and_says_what_it_was_built_with(cpu_kernels):
    """The build make install made (compiled, or an earlier build of the same key) says what it was
    built from and with, and is kept: building again finds it up to date."""
    folder = build.kernels_dir()
    manifest = json.loads((folder / build.MANIFEST).read_text())
    # the installed distribution's version, which the check reads (a CUDA build's torch.__version__ adds +cu130)
    assert manifest["sources"] == build.sources_digest() and manifest["torch"] == importlib.metadata.version("torch")
    assert manifest["variants"] == list(build.variants())
    assert set(manifest["compilers"]) == {"CC_version", "CXX_version"}
    assert build.why_unusable(folder) is None
    assert build.build(folder) == (folder / build.LIBRARY, "up to date")  # not built again


def test_a_new_checkout_of_the_same_key_takes_the_kept_build(cpu_kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    key = build.read_manifest(build.kernels_dir())["key"]
    build._keep_build(build.kernels_dir(), key)
    checkout = tmp_path / "checkout" / "build" / "kernels"
    assert build.build(checkout) == (checkout / build.LIBRARY, "from the build cache")
    assert (checkout / build.LIBRARY).read_bytes() == (build.kernels_dir() / build.LIBRARY).read_bytes()
    assert build.why_unusable(checkout) is None
    for i in range(build.KEEP_BUILDS + 2):  # older keys' builds: the newest KEEP_BUILDS stay
        build._keep_build(build.kernels_dir(), f"{i:064x}")
    kept = {path.name for path in build.builds_dir().iterdir()}
    assert len(kept) == build.KEEP_BUILDS and key not in kept and f"{build.KEEP_BUILDS + 1:064x}" in kept


def test_a_stale_or_missing_build_is_refused_by_name(tmp_path):
    assert "not built" in build.why_unusable(tmp_path)
    shutil.copy(build.kernels_dir() / build.MANIFEST, tmp_path)
    (tmp_path / build.LIBRARY).touch()
    manifest = json.loads((tmp_path / build.MANIFEST).read_text())
    (tmp_path / build.MANIFEST).write_text(json.dumps(manifest | {"sources": "0" * 64}))
    assert "other sources" in build.why_unusable(tmp_path)
    (tmp_path / build.MANIFEST).write_text(json.dumps(manifest | {"torch": "1.0.0"}))
    assert "built for torch 1.0.0" in build.why_unusable(tmp_path)


def test_the_variant_is_the_best_this_cpu_runs(cpu_kernels):
    flags = host_cpu_flags()
    runnable = torch.ops.switchyard_cpu.variants()
    assert runnable[-1] == "portable" and cpu_kernels.variant == runnable[0]
    for name, needs in LEVEL_FLAGS.items():
        if name in build.variants():
            assert (name in runnable) == (needs <= flags), name
    with pytest.raises(RuntimeError, match="no kernel variant named"):
        torch.ops.switchyard_cpu.use_variant("avx1024")
    for name in set(build.variants()) - set(runnable):
        with pytest.raises(RuntimeError, match="this CPU cannot run"):
            torch.ops.switchyard_cpu.use_variant(name)


def test_the_worker_says_which_kernels_it_runs(cpu_kernels, default_model_path):
    from services.worker.backends.spec import WorkerSpec
    from services.worker.backends.torch_cpu.backend import TorchCpuBackend

    spec = WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 0, num_kv_blocks=8, quantization="gguf")
    device = TorchCpuBackend.create(spec).describe().device
    assert device == f"cpu (float32, gguf weights, C kernels ({cpu_kernels.variant}))"


def test_each_build_compiles_into_an_inductor_cache_of_its_own(cpu_kernels, tmp_path):
    """Inductor's cache knows an op by its name: a graph compiled against an older build (another
    schema of quant_linear) was loaded from it and crashed the worker. Loading the kernels points
    Inductor at a directory named for this build, beneath the user's or torch's own."""
    import os

    from services.worker.backends.torch_cpu.kernels.load import inductor_cache_dir

    key = build.read_manifest(build.kernels_dir())["key"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith(f"switchyard-kernels-{key[:16]}")
    mine = inductor_cache_dir("a" * 64, str(tmp_path))
    assert mine == str(tmp_path / ("switchyard-kernels-" + "a" * 16))
    assert inductor_cache_dir("a" * 64, mine) == mine  # a child process of the worker: not nested again
    assert inductor_cache_dir("b" * 64, str(tmp_path)) != mine  # another build: another directory
