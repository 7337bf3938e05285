"""What the deploy tests share beyond their fixtures: the stack's key and start-up, a chat template."""

from __future__ import annotations

import os

from tests.oci_helpers import OciRegistry

API_KEY = "sk-deploy-test"
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
           "<|im_start|>assistant\nSure. "


def start(tmp_path_factory, store: str, registry: OciRegistry):
    from tests.conftest import _start_stack

    return _start_stack(tmp_path_factory, "deploy", num_workers=1, nats_store=store, extra_args=[
        "--api-key", API_KEY, "--agent-cpus", "8", "--engine-cpus", "4", "--scale-up-after-s", "2", "--scale-down-after-s", "3",
        "--oci-registry", f"http://{registry.host}/switchyard"])


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
