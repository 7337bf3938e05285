"""`python -m bench.images`: Gemma 3's image path on this machine: images per second through its
encoder (in process), and time to first token for one image at c=1 and c=8 through the stack.

    python -m bench.images [--image-size 896] [--vision-layers 27] [--text-layers 4] [--concurrency 1,8]
        [--service-args "--idle-timeout-s 3600"]

Random weights saved by transformers for Gemma 3's vision tower (SigLIP-So400m's geometry: 1,152
wide, 27 layers, 14-pixel patches, 896 pixels a side: 4,096 patches pooled to 256 tokens) and a
small language model of Gemma 3's layout (--text-layers layers, 1,152 wide): the encoder is what an
image costs. Every request has its own picture, so no feature or prefix cache helps. Prints a
markdown table (the CPU named). On a CPU an image costs the encoder about a minute, one after
another, so a queue of them outlasts the gateway's --idle-timeout-s (300 s): raise it for c=8.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import io
import json
import os
import statistics
import tempfile
import time

import httpx
import numpy as np
import torch
from PIL import Image

from bench.cpu_flags import cpu_name
from shared.models.model_files import default_model_path
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port

NAME = "gemma3-bench"
# Gemma 3's chat template, its image and text parts as the Hub's writes them (tests use it too)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# Qwen2.5-VL's chat template, its system turn, image and text parts as the Hub's writes them (videos left out)
QWEN25VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

def write_checkpoint(folder: str, image_size: int, vision_layers: int, text_layers: int) -> None:
    import transformers

    path, name = os.path.split(default_model_path())
    tokenizer = copy.deepcopy(transformers.AutoTokenizer.from_pretrained(path, gguf_file=name))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                                "<image_soft_token>"]})
    tokenizer.chat_template = GEMMA3_TEMPLATE
    boi, eoi, image = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    config = transformers.Gemma3Config(
        text_config=dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=text_layers,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=len(tokenizer),
                         sliding_window=512, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=vision_layers,
                           num_attention_heads=16, patch_size=14, image_size=image_size, vision_use_head=False),
        mm_tokens_per_image=256, image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    transformers.Gemma3ForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def encoder_rate(folder: str, image_size: int, batch: int) -> float:
    """Images per second through the loaded tower, float32 on torch's ops, `batch` at a time."""
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model

    tower = load_model(folder, ops=TORCH_OPS).model.vision
    pixels = torch.randn(batch, 3, image_size, image_size)
    with torch.inference_mode():
        tower(pixels[:1])  # warm
        started = time.perf_counter()
        tower(pixels)
    return batch / (time.perf_counter() - started)


def picture(seed: int) -> str:
    pixels = (np.random.default_rng(seed).random((480, 640, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def ttft(http: httpx.AsyncClient, seed: int) -> float:
    """Seconds from the POST to the first streamed token of a chat about one picture of its own."""
    body = {"model": NAME, "stream": True, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": picture(seed)}}, {"type": "text", "text": "Describe it."}]}]}
    started = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # the first chunk names the role alone: a token's has text
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            if "error" in chunk:
                raise RuntimeError(f"the request failed: {chunk['error']}")
            if (chunk.get("choices") or [{}])[0].get("delta", {}).get("content"):
                return time.perf_counter() - started
            if line == "data: [DONE]":  # four tokens without text (held back, or empty): the stream's end
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without [DONE]")


async def through_stack(base_url: str, concurrency: list[int]) -> dict[int, list[float]]:
    out, seed = {}, 100
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as http:
        await ttft(http, 0)  # warm: the first forward's allocations
        for c in concurrency:
            rounds = 3 if c == 1 else 1
            times = []
            for _ in range(rounds):
                times += await asyncio.gather(*(ttft(http, seed + i) for i in range(c)))
                seed += c
            out[c] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image-size", type=int, default=896)
    parser.add_argument("--vision-layers", type=int, default=27)
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--service-args", default="", help="added to every service's flags")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-images-") as folder:
        write_checkpoint(folder, args.image_size, args.vision_layers, args.text_layers)
        rates = {b: encoder_rate(folder, args.image_size, b) for b in (1, 2)}
        nats = NatsServer().start()
        stack = Stack(nats_url=nats.url, api_port=free_port(), service_args=[
            "--model-path", folder, "--model", NAME, "--max-model-len", "2048", *args.service_args.split()])
        stack.nats = nats
        try:
            stack.start().wait_ready(timeout=1800)
            times = asyncio.run(through_stack(stack.base_url, concurrency))
        finally:
            stack.stop()
    print(f"\nGemma 3 image path, random weights: SigLIP {args.vision_layers} layers at {args.image_size} px "
          f"({(args.image_size // 14) ** 2} patches -> 256 tokens), language model {args.text_layers} layers; "
          f"{cpu_name()}\n")
    print("| measure | value |\n|---|---|")
    for b, rate in rates.items():
        print(f"| encoder, in process (float32, torch ops), batch {b} | {rate:.3f} images/s |")
    for c, values in times.items():
        print(f"| TTFT, one image per request, c={c} (stack, `make run`'s defaults) | p50 {statistics.median(values):.2f} s, "
              f"max {max(values):.2f} s over {len(values)} |")


if __name__ == "__main__":
    main()
