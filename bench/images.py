"""`python -m bench.images`: an image-text model's image path on this machine: images per second
through its encoder (in process), and time to first token for one image at c=1 and c=8 through the stack.

    python -m bench.images [--family gemma3|qwen25vl] [--image-size 896] [--vision-layers N]
        [--text-layers 4] [--concurrency 1,8] [--service-args "--idle-timeout-s 3600"]

Random weights saved by transformers for the family's vision tower at its real geometry (Gemma 3:
SigLIP-So400m's, 1,152 wide, 27 layers, 14-pixel patches, 896 pixels a side: 4,096 patches pooled
to 256 tokens; Qwen2.5-VL: 1,280 wide, 32 layers, the benchmark's 640 x 480 picture at its own size,
644 x 476: 1,564 patches merged to 391 tokens) and a small language model of the family's layout
(--text-layers layers): the encoder is what an image costs. Every request has its own picture, so no feature or prefix cache helps. Prints a
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

NAME = "images-bench"
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

def _tokenizer(tokens: list[str], template: str):
    """SmolLM2's tokenizer with the family's image tokens added and its chat template."""
    import transformers

    path, name = os.path.split(default_model_path())
    tokenizer = copy.deepcopy(transformers.AutoTokenizer.from_pretrained(path, gguf_file=name))
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = template
    return tokenizer, tokenizer.convert_tokens_to_ids(tokens)


def write_checkpoint(folder: str, family: str, image_size: int, vision_layers: int, text_layers: int) -> None:
    """gemma3: SigLIP-So400m's geometry at image_size pixels a side, 1,152-wide language layers;
    qwen25vl: Qwen2.5-VL's vision transformer (1,280 wide, its four full-attention layers among
    vision_layers; 28-pixel tokens) and 3B's language width (2,048), its processor's defaults."""
    import transformers

    if family == "qwen25vl":
        tokenizer, (start, end, image) = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"],
                                                    QWEN25VL_TEMPLATE)
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=text_layers,
                             num_attention_heads=16, num_key_value_heads=2, vocab_size=len(tokenizer),
                             max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id,
                             rope_parameters=dict(rope_type="default", mrope_section=[16, 24, 24], rope_theta=1e6)),
            vision_config=dict(depth=vision_layers, hidden_size=1280, intermediate_size=3420, num_heads=16,
                               out_hidden_size=2048, fullatt_block_indexes=[i for i in (7, 15, 23, 31)
                                                                            if i < vision_layers]),
            image_token_id=image, video_token_id=image, vision_start_token_id=start, vision_end_token_id=end)
        transformers.Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(folder)
    else:
        tokenizer, (boi, eoi, image) = _tokenizer(["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                                                  GEMMA3_TEMPLATE)
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


def encoder_rate(folder: str, batch: int) -> tuple[float, int]:
    """Images per second through the loaded tower (float32 on torch's ops, `batch` at a time) for
    the benchmark's picture as the gateway resizes it, and the image tokens it makes."""
    from services.api.media.images import decode, resized_pixels
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.images import image_spec
    from services.worker.loader import load_model

    loaded = load_model(folder, ops=TORCH_OPS)
    spec, tower = image_spec(loaded.config.vision), loaded.model.vision
    image = decode(base64.b64decode(picture(0).split(",", 1)[1]))
    width, height = spec.resized(*image.size)
    pixels = torch.frombuffer(bytearray(resized_pixels(image, width, height, spec.resample)),
                              dtype=torch.uint8).view(height, width, 3)
    with torch.inference_mode():
        tower.encode([pixels])  # warm
        started = time.perf_counter()
        tower.encode([pixels] * batch)
    return batch / (time.perf_counter() - started), spec.tokens_for(width, height)


def picture(seed: int) -> str:
    """A 640 x 480 JPEG of noise, as a data URL."""
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
    parser.add_argument("--family", choices=("gemma3", "qwen25vl"), default="gemma3")
    parser.add_argument("--image-size", type=int, default=896, help="gemma3's square")
    parser.add_argument("--vision-layers", type=int, default=None, help="default: the family's (27, 32)")
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--service-args", default="", help="added to every service's flags")
    args = parser.parse_args()
    layers = args.vision_layers or {"gemma3": 27, "qwen25vl": 32}[args.family]
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    with tempfile.TemporaryDirectory(prefix="bench-images-") as folder:
        write_checkpoint(folder, args.family, args.image_size, layers, args.text_layers)
        rates = {b: encoder_rate(folder, b) for b in (1, 2)}
        times = {}
        if concurrency:
            nats = NatsServer().start()
            stack = Stack(nats_url=nats.url, api_port=free_port(), service_args=[
                "--model-path", folder, "--model", NAME, "--max-model-len", "2048", *args.service_args.split()])
            stack.nats = nats
            try:
                stack.start().wait_ready(timeout=1800)
                times = asyncio.run(through_stack(stack.base_url, concurrency))
            finally:
                stack.stop()
    tokens = rates[1][1]
    tower = (f"SigLIP {layers} layers at {args.image_size} px ({(args.image_size // 14) ** 2} patches -> 256 tokens)"
             if args.family == "gemma3" else
             f"Qwen2.5-VL's vision transformer, {layers} layers, a 640x480 picture resized to {tokens} tokens "
             f"({tokens * 4} patches)")
    print(f"\n{args.family} image path, random weights: {tower}, language model {args.text_layers} layers; "
          f"{cpu_name()}\n")
    print("| measure | value |\n|---|---|")
    for b, (rate, _) in rates.items():
        print(f"| encoder, in process (float32, torch ops), batch {b} | {rate:.3f} images/s |")
    for c, values in times.items():
        print(f"| TTFT, one image per request, c={c} (stack, `make run`'s defaults) | p50 {statistics.median(values):.2f} s, "
              f"max {max(values):.2f} s over {len(values)} |")


if __name__ == "__main__":
    main()
