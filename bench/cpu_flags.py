"""`python -m bench.cpu_flags`: the CMake flags that build llama.cpp for this CPU's instruction sets.

ggml's native build (-march=native) is not safe on these VMs: some advertise AMX without granting
its tile state (SIGILL in `tilezero`, seen 2026-11-22), and a fixed list of flags is not safe either:
an AMD EPYC VM has AVX-512 VNNI but not the VEX-encoded AVX-VNNI, and a build with GGML_AVX_VNNI
died of SIGILL at load. So each ggml option is turned on exactly when /proc/cpuinfo lists its
instructions, and AMX never is.
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.cpu_features import cpu_flags

# ggml's CMake option -> the /proc/cpuinfo flag its instructions need
GGML_OPTIONS = {
    "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_AVX_VNNI": "avx_vnni",
    "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
}


def cpu_name() -> str:
    """The CPU's model name, core count and the instruction sets that matter here, for a result's record."""
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = cpu_flags(info)
    has = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} cores ({', '.join(has) or 'no AVX2'})"


def cmake_args(flags: set[str]) -> list[str]:
    return ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if need in flags else 'OFF'}" for opt, need in GGML_OPTIONS.items()]


if __name__ == "__main__":
    print(" ".join(cmake_args(cpu_flags(Path("/proc/cpuinfo").read_text()))))
