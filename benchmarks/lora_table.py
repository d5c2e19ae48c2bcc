"""The executor's stacked LoRA table (`services.executor.lora_stack`): the time to build it in
full from 16 resident adapters against the time one slot taking another adapter costs now
(only that slot's regions written in place), at rank 8 and 64, SmolLM2 in bfloat16.

    .venv/bin/python -m benchmarks.lora_table [--model smollm2] [--slots 16] [--rounds 5]

Adapters as `benchmarks.lora` writes them (every projection targeted). One process, medians of
--rounds; on a shared host read the ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from benchmarks.lora import write_adapter
from services.executor.lora_stack import StackedSlots
from services.executor.lora_weights import load_lora
from shared.lora_files import BaseShapes, read_adapter
from shared.messages import LoraAdapter
from shared.model_files import default_served_name, resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    base = dataclasses.replace(BaseShapes.of_config(AutoConfig.from_pretrained(model_dir).get_text_config()),
                               names=frozenset())
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="lora-table-") as tmp:
        for rank in (8, 64):
            weights = []
            for i in range(args.slots + 1):
                path = write_adapter(Path(tmp) / f"r{rank}-{i}", base, rank, i, default_served_name(args.model))
                adapter = LoraAdapter(path.name, str(path), read_adapter(path).digest)
                weights.append(load_lora(adapter, base, max(rank, 64), torch.bfloat16, "cpu"))
            full, one = [], []
            for _ in range(args.rounds):
                start = time.perf_counter()
                table = StackedSlots(weights[: args.slots], cpu, torch.bfloat16)
                full.append(time.perf_counter() - start)
            for k in range(args.rounds):  # slot 0 swaps between two adapters of one rank
                start = time.perf_counter()
                table.update({0: weights[args.slots if k % 2 == 0 else 0]})
                one.append(time.perf_counter() - start)
            f, o = statistics.median(full) * 1e3, statistics.median(one) * 1e3
            print(f"rank {rank:2d}, {args.slots} slots: full build {f:7.1f} ms, one slot's change {o:6.1f} ms "
                  f"({f / o:.0f}x less), median of {args.rounds}", flush=True)


if __name__ == "__main__":
    main()
