"""Multi-LoRA decode steps in process: the time of one `ModelRunner.compute_logits` decode step
of m rows (their adapters prepared, the forward pass, no sampling) under the base model alone
and under k distinct adapters of rank r, the i-th row under adapter i mod k (as the
scheduler interleaves them). No server, no scheduler: this isolates the executor's cost.

    .venv/bin/python -m benchmarks.lora_step [--model smollm2] [--rows 16,64] [--cases 1x8,4x8,16x8,4x64]
                                             [--forms grouped,torch,kernel] [--threads N]

Forms: `grouped` runs every projection by `kernels.lora.add_lora` (per adapter group, the
form before stacking), `torch` by `kernels.lora_stacked`'s torch form where the executor
stacks, `kernel` by the C++ kernel (`lora_grouped`, the executor's default on the CPU),
`auto` as the executor does by default. `--threads` sets torch's threads (as
`--executor-threads` does; on a host crowded by other jobs one thread spares the steps the
waits of a second one that is not running). Each case's forms alternate
with a base step, round after round, so a burst of load from another process slows all
alike; printed: median ms of each and their ratio (base / LoRA: the share of the base
model's throughput a LoRA step keeps).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from benchmarks.lora import write_adapter
from services.executor import lora_stack
from services.executor.model_runner import ModelRunner
from services.executor.step_calibration import decode_step
from shared.lora_files import BaseShapes, read_adapter
from shared.lora_options import LoraOptions
from shared.messages import ExecuteStep, LoraAdapter
from shared.model_files import default_served_name, resolve_model


def lora_step(step: ExecuteStep, adapters: list[LoraAdapter]) -> ExecuteStep:
    seqs = [msgspec.structs.replace(s, lora_slot=i % len(adapters)) for i, s in enumerate(step.seqs)]
    used = sorted({i % len(adapters) for i in range(len(seqs))})
    return ExecuteStep(step_id=step.step_id, seqs=seqs, lora_slots=[(i, adapters[i]) for i in used])


def step_ms(runner: ModelRunner, step: ExecuteStep) -> float:
    start = time.perf_counter()
    runner.compute_logits(step)
    return (time.perf_counter() - start) * 1e3


# form: (MAX_STACKED_FRACTION, USE_CPU_KERNEL)
FORMS = {"grouped": (0.0, False), "torch": (lora_stack.MAX_STACKED_FRACTION, False),
         "kernel": (lora_stack.MAX_STACKED_FRACTION, True),
         "auto": (lora_stack.MAX_STACKED_FRACTION, lora_stack.USE_CPU_KERNEL)}


def use_form(runner: ModelRunner, form: str, tables: dict) -> None:
    """Each form's stacked slots, built once per case (a step right after a rebuild runs on cold
    memory)."""
    lora_stack.MAX_STACKED_FRACTION, lora_stack.USE_CPU_KERNEL = FORMS[form]
    runner.loras._stacked = tables.get(form)
    if runner.loras._stacked is None:
        runner.loras._stacked = tables[form] = lora_stack.StackedSlots(runner.loras.slots, runner.device,
                                                                        runner.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", default="16,64")
    p.add_argument("--cases", default="1x8,4x8,16x8,4x64", help="adapters x rank, comma separated")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--forms", default="grouped,torch,kernel")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    model_dir = resolve_model(args.model)
    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    base = BaseShapes.of_config(config)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    runner = ModelRunner(model_dir, lora_options=LoraOptions(max_loras=max(k for k, _ in cases),
                                                             max_lora_rank=max(r for _, r in cases)))
    with tempfile.TemporaryDirectory(prefix="lora-step-") as tmp:
        adapters: dict[tuple[int, int], list[LoraAdapter]] = {}
        for k, rank in cases:
            adapters[k, rank] = []
            for i in range(k):
                path = Path(tmp) / f"r{rank}-{i}"
                if not path.exists():
                    write_adapter(path, base, rank, i, default_served_name(args.model))
                adapters[k, rank].append(LoraAdapter(path.name, str(path), read_adapter(path).digest))
        print(f"{args.model} ({runner.dtype}, {torch.get_num_threads()} threads): decode step ms, median of "
              f"{args.rounds} (base / LoRA ratio)")
        for rows in (int(r) for r in args.rows.split(",")):
            base_step = decode_step(rows, args.context, runner.block_size, runner.num_kv_blocks)
            for k, rank in cases:
                step = lora_step(base_step, adapters[k, rank])
                forms, tables = args.forms.split(","), {}
                times: dict[str, list[float]] = {"base": [], **{f: [] for f in forms}}
                step_ms(runner, step)  # loads the slots
                for _ in range(args.rounds + 2):  # the first two warm up
                    times["base"].append(step_ms(runner, base_step))
                    for form in forms:
                        use_form(runner, form, tables)
                        times[form].append(step_ms(runner, step))
                med = {form: statistics.median(t[2:]) for form, t in times.items()}
                print(f"m={rows:3d} {k:2d} adapters rank {rank:2d}: base {med['base']:7.2f} ms, "
                      + ", ".join(f"{f} {med[f]:7.2f} ms ({med['base'] / med[f]:.2f}x)" for f in forms), flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
