"""llama.cpp's peer build turns on exactly the instruction sets the CPU lists (bench/cpu_flags.py)."""

from __future__ import annotations

from bench.cpu_flags import cmake_args, cpu_flags

EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 avx512vbmi\n"


def test_only_listed_instruction_sets_are_enabled():
    args = cmake_args(cpu_flags(EPYC))
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512_VNNI=ON" in args and "-DGGML_AVX512_BF16=ON" in args
    assert "-DGGML_AVX_VNNI=OFF" in args  # AVX-512 VNNI is not the VEX-encoded AVX-VNNI (SIGILL on such a VM)
    assert not any("AMX" in a for a in args)


def test_a_cpu_without_avx512_gets_none_of_it():
    args = cmake_args(cpu_flags("flags\t\t: sse2 avx avx2 fma f16c avx_vnni\n"))
    assert "-DGGML_AVX2=ON" in args and "-DGGML_AVX_VNNI=ON" in args
    assert all(a.endswith("=OFF") for a in args if "AVX512" in a)
