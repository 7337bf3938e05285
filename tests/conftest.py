"""Session fixtures: the real default model (loaded once) and a real nats-server per session."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

# xdist's workers share the cores: each takes its share of torch's threads (children inherit it), or
# two processes' OpenMP regions wait on each other's descheduled threads (5x slower on 2 cores)
if (_workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    _share = max(1, (os.cpu_count() or 1) // _workers)
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on the CPU (before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the suite's stacks run `make run`'s defaults for this CPU (the C kernels, each row computed alone,
# so tokens do not depend on the batch); a test that compares with transformers or with the
# reference's exact bits asks for --deterministic itself

from shared.models.model_files import default_model_path as _default_model_path


def pytest_collection_finish(session):
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in sys.modules:
        from tests.triton_interpreter import skip_repeated_patches, skip_unreported_overflow_checks

        skip_repeated_patches()
        skip_unreported_overflow_checks()


@pytest.fixture(scope="session")
def default_model_path() -> str:
    return _default_model_path()


@pytest.fixture(scope="session")
def cpu_kernels():
    """The C kernels' library as torch ops (make install builds it; the fast path runs on it)."""
    from services.worker.backends.torch_cpu.kernels.load import load

    kernels = load()
    assert kernels.loaded, kernels.reason
    return kernels


@pytest.fixture(scope="session")
def loaded_model(default_model_path):
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model

    return load_model(default_model_path, ops=TORCH_OPS)


@pytest.fixture(scope="session")
def served_model(default_model_path, cpu_kernels):
    """The default model as `make run` serves it on this CPU, eagerly: the C kernels over the GGUF's
    own blocks (--quantization auto is `gguf` for it), never dequantized, loaded by the worker's own
    function. loaded_model is the reference (--deterministic's torch float32 ops)."""
    from services.worker.backends.spec import WorkerSpec
    from services.worker.backends.torch_cpu.backend import load_as_filed

    return load_as_filed(default_model_path, WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 0),
                         native=True)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers' own LlamaForCausalLM on the same GGUF: the oracle, and the benchmark's peer."""
    transformers = pytest.importorskip("transformers")
    import torch

    folder, name = os.path.split(default_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _start_stack(tmp_path_factory, name: str, num_workers: int, extra_args: list[str], nats_store: str | None = None,
                 max_payload: int | None = None):
    """nats_store: keep JetStream (the registry) there, so a later stack on the same folder finds it;
    max_payload: the bus's largest message, if not nats-server's 1 MB."""
    from switchyard.launcher import Stack
    from switchyard.nats_server import NatsServer, free_port

    nats = NatsServer(store_dir=nats_store, auth=True, max_payload=max_payload).start()  # locked, as `make run` has it
    log_dir = tmp_path_factory.mktemp(name)
    stack = Stack(nats_url=nats.url, auth_dir=nats.auth_dir, api_port=free_port(), num_workers=num_workers,
                  log_dir=log_dir,
                  service_args=["--kv-cache-memory-gib", "0.4", "--threads", "1", *extra_args])
    stack.nats = nats  # stopped with the stack
    stack.start()
    return ready_or_stopped(stack, log_dir)


def ready_or_stopped(stack, log_dir: Path, timeout: float = 240):
    """The stack once it is ready; if it never is, stopped, with each service's log's end printed."""
    try:
        stack.wait_ready(timeout=timeout)
    except Exception:
        stack.stop()
        show_logs(log_dir)
        raise
    return stack


def show_logs(log_dir: Path) -> None:
    for log in sorted(log_dir.glob("*.log")):
        print(f"---- {log.name}\n{log.read_text()[-3000:]}")


def _written(tmp_path_factory, name: str, config: dict) -> str:
    """A config.json for the `dummy` loader's random weights, in a folder of its own."""
    path = tmp_path_factory.mktemp(name) / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory) -> str:
    """config.json of a 2-layer Llama with 4 query heads per KV head (Llama 3's ratio), for the
    `dummy` loader's random weights: what the faster backends are checked on against torch's."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
              "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
              "rms_norm_eps": 1e-5, "eos_token_id": 299}
    return _written(tmp_path_factory, "small-llama", config)


@pytest.fixture(scope="session")
def small_qwen3(tmp_path_factory) -> str:
    """config.json of a 2-layer Qwen3 (q/k RMSNorm per head, head size beside the width) for the
    `dummy` loader: the faster backends are checked on a second family beside small_llama."""
    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 96, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "eos_token_id": 299}
    return _written(tmp_path_factory, "small-qwen3", config)


@pytest.fixture(scope="session")
def small_gemma3(tmp_path_factory) -> str:
    """config.json of a 3-layer Gemma 3 (two sliding-window layers, then a global one, each with its
    rope; GeGLU; four norms a layer) for the `dummy` loader, its window of 8 tokens crossed by every
    prompt of the backends' tests."""
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 300,
              "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
              "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
              "tie_word_embeddings": True, "eos_token_id": 299}
    return _written(tmp_path_factory, "small-gemma3", config)


@pytest.fixture(scope="session")
def small_gemma2(tmp_path_factory) -> str:
    """config.json of a 2-layer Gemma 2 (a sliding-window layer of 8 tokens, then a global one) with
    soft caps low enough to bite on random weights (1.5 on attention scores, 3 on logits)."""
    config = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 300,
              "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 1.5,
              "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "eos_token_id": 299}
    return _written(tmp_path_factory, "small-gemma2", config)


@pytest.fixture(scope="session")
def small_qwen3_moe(tmp_path_factory) -> str:
    """config.json of a 2-layer Qwen3-MoE (8 experts, top 2) for the `dummy` loader."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 300, "hidden_size": 96,
              "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
              "norm_topk_prob": True, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "eos_token_id": 299}
    return _written(tmp_path_factory, "small-qwen3-moe", config)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """nats-server on a free port + kvcache + one worker + scheduler + API, real processes."""
    s = _start_stack(tmp_path_factory, "stack", num_workers=1, extra_args=[])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def openai_client(stack):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def async_openai_client(stack):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def model_name() -> str:
    from shared.config import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME

