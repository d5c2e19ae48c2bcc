"""Multi-LoRA throughput: output tokens/s of one server at concurrency 16 and 64, its requests
spread over 0 (the base model alone), 1, 4 and 16 distinct LoRA adapters of rank 8 and 64.

    .venv/bin/python -m benchmarks.lora [--model smollm2] [--concurrency 16,64] [--adapters 0,1,4,16] [--ranks 8,64]

One `pagedserve serve` (--max-loras 16, --max-lora-rank 64) holds every adapter from the
start (--lora-modules): PEFT directories written here with random A and B on every q/k/v/o
and gate/up/down projection. Each run is closed loop: --concurrency clients send
--requests-per-client requests each of a random 32-token prompt, 32 output tokens (greedy,
ignore_eos), the i-th request under adapter i mod k. Printed: output tok/s and its ratio to
the base model's at the same concurrency. Every adapter is warmed (loaded into the
executor) before the timed runs. One run each: on a shared machine, read the ratios, not
the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import openai
import torch
from safetensors.torch import save_file

from shared.lora_files import BaseShapes
from shared.model_files import default_served_name, resolve_model
from tests.helpers import ServerProcess

RANKS = (8, 64)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, base: BaseShapes, rank: int, seed: int, base_name: str) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for proj in TARGETS:
            fan_in, fan_out = base.projections[proj]
            stem = f"base_model.model.model.layers.{layer}.{'mlp' if proj.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in**-0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "base_model_name_or_path": base_name, "bias": "none"}))
    return out


async def run(url: str, models: list[str], concurrency: int, per_client: int, vocab: int, seed: int) -> float:
    """Output tokens/s of a closed loop over models."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(32)] for _ in range(concurrency * per_client)]
    tokens = 0
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600) as c:
        async def client(i: int) -> None:
            nonlocal tokens
            for j in range(per_client):
                k = i * per_client + j
                out = await c.completions.create(model=models[k % len(models)], prompt=prompts[k], max_tokens=32,
                                                 temperature=0, extra_body={"ignore_eos": True})
                tokens += out.usage.completion_tokens

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--adapters", default="0,1,4,16")
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    args = p.parse_args()
    from transformers import AutoConfig

    model_dir = resolve_model(args.model)
    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    base = BaseShapes.of_config(config)
    served = default_served_name(args.model)
    counts = [int(n) for n in args.adapters.split(",")]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        names = {rank: [f"r{rank}-{i}" for i in range(max(counts))] for rank in RANKS}
        modules = [f"{name}={write_adapter(Path(tmp) / name, base, rank, i, served)}"
                   for rank in RANKS for i, name in enumerate(names[rank])]
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        extra = ["--max-loras", str(max(counts)), "--max-lora-rank", str(max(RANKS)), "--max-num-seqs", "64",
                 "--lora-modules", *modules]
        with ServerProcess(args.model, run_dir, extra, startup_timeout=600) as server:
            warm = [served, *names[8], *names[64]]
            asyncio.run(run(server.url, warm, len(warm), 1, config.vocab_size, 0))
            print(f"{args.model}: output tok/s (ratio to the base model at the same concurrency), one run each")
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                base_tps = asyncio.run(run(server.url, [served], concurrency, args.requests_per_client,
                                           config.vocab_size, 1))
                print(f"C={concurrency:3d} base model          {base_tps:8.1f} tok/s", flush=True)
                for rank in (int(r) for r in args.ranks.split(",")):
                    for n in (n for n in counts if n):
                        tps = asyncio.run(run(server.url, names[rank][:n], concurrency, args.requests_per_client,
                                              config.vocab_size, 1))
                        print(f"C={concurrency:3d} {n:2d} adapters rank {rank:2d} {tps:8.1f} tok/s "
                              f"({tps / base_tps:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
