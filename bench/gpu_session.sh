#!/usr/bin/env bash
# A lent GPU's checks and figures in one run (docs/benchmarks.md says how to carry the runtime's
# wheels in .whl): the GPU tests of what changed, the benchmarks, then the rest of the GPU tests.
#     OUT=/tmp/gpu bash bench/gpu_session.sh [changed] [eagle3] [tier] [decode] [rest]   (default: all)
# Each part has a time limit of its own, so one that hangs leaves the others their time.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > /tmp/pip.log 2>&1 && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  nproc; } > "$OUT/machine.txt" 2>&1
# the C kernels: the CPU references of the quantized tests (built beside the first tests)
python3 -m services.worker.backends.torch_cpu.kernels.build > /tmp/kernels_build.log 2>&1 &
PYTEST="python3 -m pytest -q -p no:randomly -p no:cacheprovider -o addopts=-ra --durations=15"
parts=${*:-changed eagle3 tier decode rest}

changed() {
    timeout 200 $PYTEST tests/gpu/test_cuda_speculative.py tests/gpu/test_cuda_tier.py \
        tests/test_host_tier.py::test_worker_copies_blocks_out_and_back_bit_for_bit tests/kernels/test_cuda_backend.py \
        --deselect tests/kernels/test_cuda_backend.py::test_smollm2_greedy_tokens_equal_the_torch_backends
}
eagle3() {  # its heads are written by speculators (carried as wheels)
    timeout 90 $PYTEST tests/test_eagle3.py::test_an_eagle3_head_on_the_cuda_path_gives_the_torch_backends_tokens
}
tier() {
    timeout 60 python3 -m bench.tier_copies --out "$OUT/tier_copies.json"
}
decode() {  # Llama-3.1-8B's layers, 8 of them (random weights take ~3 s a layer to make)
    python3 -c "import json; c = json.load(open('bench/configs/llama-3.1-8b.json')); c['num_hidden_layers'] = 8; \
json.dump(c, open('/tmp/llama-8l.json', 'w'))"
    for weights in float int4; do
        timeout 80 python3 -m bench.gpu_decode --config /tmp/llama-8l.json --weights $weights --repeat 5 \
            --out "$OUT/gpu_decode_$weights.json"
    done
}
rest() {
    wait; tail -2 /tmp/kernels_build.log  # the kernels build
    timeout 150 $PYTEST tests/kernels/test_kernels.py tests/kernels/test_lora_kernel.py tests/kernels/test_quant_gemm.py \
        tests/gpu/test_cuda_families.py tests/gpu/test_cuda_images.py \
        "tests/gpu/test_cuda_worker.py::test_the_gpu_benchmark_reports_every_figure" \
        tests/gpu/test_cuda_worker.py::test_an_awq_checkpoints_integers_on_the_gpu_give_the_cpu_backends_tokens
}
for part in $parts; do
    started=$SECONDS
    $part > "$OUT/$part.log" 2>&1
    echo "$part rc=$? $((SECONDS - started)) s" >> "$OUT/machine.txt"
done
