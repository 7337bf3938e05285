"""Hub ids as model paths (shared/models/hub.py) against a local server speaking the Hub's HTTP API
(tests/hub_server.py): a GGUF picked by tag, a transformers checkpoint, the offline cache, each
failure's message, and a stack and the SDK serving a Hub id."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hub_server import HubServer, Repo

GGUF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
CHECKPOINT_REPO = "acme/tiny-llama"
PRIVATE_REPO = "acme/private-smol"
TOKEN = "hf_test_token"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random 2-layer Llama saved by transformers (SmolLM2's vocabulary size), with a tokenizer."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hub(default_model_path, checkpoint):
    gguf = Path(default_model_path)
    readme = ROOT / "README.md"
    checkpoint_files = {p.name: p for p in checkpoint.iterdir()} | {"README.md": readme,
                                                                    "original/consolidated.pth": readme}
    server = HubServer({
        # the file under two quantizations' names: which one is fetched is the point, not its bytes
        GGUF_REPO: Repo({"smollm2-135m-instruct-q4_1.gguf": gguf, "smollm2-135m-instruct-q8_0.gguf": gguf,
                         "README.md": readme}),
        CHECKPOINT_REPO: Repo(checkpoint_files),
        PRIVATE_REPO: Repo({"smol.Q4_1.gguf": gguf}, private_token=TOKEN),
    }).start()
    yield server
    server.stop()


@pytest.fixture
def hf_env(hub, tmp_path) -> dict:
    """huggingface_hub's own environment, pointed at the local Hub and a fresh cache."""
    return dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_PROGRESS_BARS="1",
                HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))


def fetch(env: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.models.hub", *args], env=env | extra, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def downloads(hub: HubServer) -> set[str]:
    return {path.rsplit("/", 1)[-1] for method, path in hub.requests if method == "GET" and "/resolve/" in path}


def test_a_gguf_is_picked_by_its_tag_and_then_served_from_the_cache(hub, hf_env, default_model_path):
    hub.requests.clear()
    first = fetch(hf_env, f"{GGUF_REPO}:Q4_1")
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert path.endswith("smollm2-135m-instruct-q4_1.gguf") and filecmp.cmp(path, default_model_path, shallow=False)
    assert downloads(hub) == {"smollm2-135m-instruct-q4_1.gguf"}  # the other quantization is never fetched
    offline = fetch(hf_env, f"{GGUF_REPO}:q4_1", HF_HUB_OFFLINE="1")  # tags match whatever their case
    assert offline.returncode == 0 and offline.stdout.strip() == path, offline.stderr
    unreachable = fetch(hf_env, f"{GGUF_REPO}:Q4_1", HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there
    assert unreachable.returncode == 0 and unreachable.stdout.strip() == path, unreachable.stderr
    missing = fetch(hf_env, f"{GGUF_REPO}:Q8_0", HF_HUB_OFFLINE="1")  # offline, and never fetched
    assert missing.returncode == 1 and f"{GGUF_REPO}:Q8_0 is not in the cache" in missing.stderr
    assert "HF_HUB_OFFLINE is set" in missing.stderr


def test_a_checkpoint_is_fetched_with_its_weights_config_and_tokenizer_only(hub, hf_env, checkpoint):
    hub.requests.clear()
    result = fetch(hf_env, CHECKPOINT_REPO)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in checkpoint.iterdir())
    assert all(filecmp.cmp(folder / p.name, p, shallow=False) for p in checkpoint.iterdir())
    assert "consolidated.pth" not in downloads(hub) and "README.md" not in downloads(hub)


@pytest.mark.parametrize(("model", "extra", "words"), [
    (f"{PRIVATE_REPO}:Q4_1", [], [PRIVATE_REPO, "private", "no token is set (HF_TOKEN)"]),
    ("acme/no-such-repo", [], ["acme/no-such-repo", "check the id"]),
    (f"{GGUF_REPO}:Q4_1", ["--revision", "v9.9"], [GGUF_REPO, "'v9.9'", "no such revision", "--revision"]),
    (GGUF_REPO, [], [GGUF_REPO, "no GGUF to pick by default", f"{GGUF_REPO}:TAG",
                     "smollm2-135m-instruct-q4_1.gguf, smollm2-135m-instruct-q8_0.gguf"]),
    (f"{GGUF_REPO}:Q5_K_M", [], [GGUF_REPO, "no GGUF tagged 'Q5_K_M'"]),
])
def test_what_cannot_be_fetched_says_which_repo_and_what_to_do(hf_env, model, extra, words):
    started = time.monotonic()
    result = fetch(hf_env, model, *extra)
    assert result.returncode == 1 and result.stdout == ""
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and "Traceback" not in result.stderr
    assert all(w in message for w in words), message
    assert time.monotonic() - started < 30


def test_a_private_repo_is_fetched_with_its_token(hf_env):
    result = fetch(hf_env, f"{PRIVATE_REPO}:Q4_1", HF_TOKEN=TOKEN)
    assert result.returncode == 0 and result.stdout.strip().endswith("smol.Q4_1.gguf"), result.stderr


def test_a_download_cut_mid_file_fails_within_seconds_and_the_next_run_completes(tmp_path, default_model_path):
    gguf = Path(default_model_path)
    cut = HubServer({"acme/cut": Repo({"m.Q4_1.gguf": gguf}, cut_after={"m.Q4_1.gguf": 4 << 20})}).start()
    env = dict(os.environ, HF_ENDPOINT=cut.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONPATH=str(ROOT))
    try:
        started = time.monotonic()
        result = fetch(env, "acme/cut:Q4_1")  # 4 MiB arrive, then the connection and the server are gone
        assert result.returncode == 1 and time.monotonic() - started < 30
        message = result.stderr.strip().splitlines()[-1]
        assert "acme/cut:Q4_1" in message and "the download from" in message and "run again" in message, message
        cut.start()  # the Hub is back
        again = fetch(env, "acme/cut:Q4_1")
        assert again.returncode == 0 and filecmp.cmp(again.stdout.strip(), gguf, shallow=False), again.stderr
    finally:
        cut.stop()


@pytest.mark.stack
def test_a_stack_serves_a_hub_id_under_its_name_as_the_local_file_is_served(
        hub, hf_env, tmp_path_factory, monkeypatch, openai_client, model_name):
    """--model-path org/name:TAG: the launcher fetches it once, the services load it offline, the
    served name is the id (vLLM's default), and greedy answers equal the same file served by path;
    the SDK uploads a Hub id too."""
    openai = pytest.importorskip("openai")
    from tests.conftest import _start_stack

    for key in ("HF_ENDPOINT", "HF_HOME", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.setenv(key, hf_env[key])
    model_id = f"{GGUF_REPO}:Q4_1"
    stack = _start_stack(tmp_path_factory, "hub-stack", 1, ["--model-path", model_id])
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [model_id]
        ask = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0}
        ours = client.chat.completions.create(model=model_id, **ask).choices[0].message.content
        assert ours == openai_client.chat.completions.create(model=model_name, **ask).choices[0].message.content
        # the SDK in a process of its own: huggingface_hub reads HF_ENDPOINT once, at its import
        sdk = subprocess.run([sys.executable, "-c", "import sys; from switchyard.client import Client; "
                              "v = Client(sys.argv[1]).upload_model('smol-from-hub', sys.argv[2]); print(v.name, v.status)",
                              stack.base_url, model_id], env=hf_env, capture_output=True, text=True, timeout=300)
        assert sdk.stdout.split() == ["smol-from-hub", "ready"], sdk.stderr
    finally:
        stack.stop()
