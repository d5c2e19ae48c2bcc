"""One rank of a tensor-parallel ModelRunner, as its own process, for tests/executor/test_tensor_parallel.py.

    python -m tests.executor.tp_ranks --model DIR --rank R --size N --init tcp://127.0.0.1:PORT --prompts JSON --out FILE

Rank 0 drives greedy decoding of the prompts (one prefill step of all of them, then
decode steps of all together), handing each step to the other ranks through the
group as the executor stage does; the other ranks run `Executor.follow`, the stage's
own loop. Rank 0 writes every step's float32 logits and the greedy tokens to --out
(torch.save), with whether rank 0 used int4/int8 copies (`--quantization`). `drive`
with a size-1 group is the reference run. --loras (JSON, one [name, path, digest] or
null per prompt) runs each prompt under its LoRA adapter (a slot per distinct adapter);
rank 0 also writes the prompts whose adapter failed to load.
"""

from __future__ import annotations

import argparse
import json

import torch

from services.executor.model_runner import ModelRunner
from services.executor.service import Executor
from services.executor.tp_group import TPGroup, leave
from shared.lora_options import LoraOptions
from shared.messages import ExecuteStep, LoraAdapter, RankStop, ScheduledSeq, SeqSampling

GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)


def make_runner(model: str, group: TPGroup, quantization: str = "none", int4_max_rows: int | None = None) -> ModelRunner:
    return ModelRunner(model, dtype="float32", num_kv_blocks=64, quantization=quantization,
                       int4_max_rows=int4_max_rows, tp=group, lora_options=LoraOptions(max_loras=4, max_lora_rank=16))


def quantized(runner: ModelRunner) -> dict[str, bool]:
    """Whether every decoder linear has an int4 copy in use, and the head an int8 one."""
    model = runner.model
    return {"int4": all(m.int4 is not None and m.int4.max_rows > 0 for m in model.decoder_linears()),
            "int8_head": model.head_int8 is not None and model.head_int8.max_rows > 0}


def drive(runner: ModelRunner, group: TPGroup, prompts: list[list[int]], max_tokens: int,
          loras: list[LoraAdapter | None] | None = None, failed: set[int] | None = None):
    """(logits of every step, greedy tokens per prompt), each step handed to the group first; loras:
    each prompt's adapter (None: the base), failed: gets the prompts whose adapter failed."""
    bs = runner.block_size
    tables = [list(range(1 + i * 8, 1 + (i + 1) * 8)) for i in range(len(prompts))]
    loras = loras or [None] * len(prompts)
    slot_of = {a.name: s for s, a in enumerate({a.name: a for a in loras if a is not None}.values())}
    lora_slots = sorted({(slot_of[a.name], a) for a in loras if a is not None}, key=lambda p: p[0])

    def seq(i, tokens, start):
        slots = [tables[i][p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
        return ScheduledSeq(request_id=str(i), token_ids=tokens, start_pos=start, block_table=tables[i],
                            slot_mapping=slots, sample=True, output_index=start, sampling=GREEDY,
                            lora_slot=-1 if loras[i] is None else slot_of[loras[i].name])

    out: list[list[int]] = [[] for _ in prompts]
    logits_per_step = []
    for step_id in range(max_tokens):
        if step_id == 0:
            seqs = [seq(i, p, 0) for i, p in enumerate(prompts)]
        else:
            seqs = [seq(i, [o[-1]], len(p) + len(o) - 1) for i, (p, o) in enumerate(zip(prompts, out, strict=True))]
        step = ExecuteStep(step_id=step_id, seqs=seqs, lora_slots=lora_slots)
        group.send(step)
        logits, meta = runner.compute_logits(step)
        if failed is not None and meta.lora is not None:
            failed.update(meta.lora.failed)
        logits_per_step.append(logits.clone())
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return logits_per_step, out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--prompts", default="[]")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--quantization", default="none")
    p.add_argument("--int4-max-rows", type=int, default=None)
    p.add_argument("--loras", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    group = TPGroup.join(args.rank, args.size, args.init, torch.device("cpu"))
    runner = make_runner(args.model, group, args.quantization, args.int4_max_rows)
    if args.rank > 0:
        code = Executor(argparse.Namespace(executor_id=None)).follow(runner, group)
        if code == 0:
            group.close()  # as the executor stage does: an exit racing gloo's threads can abort (134)
        return code
    loras = None if args.loras is None else [None if a is None else LoraAdapter(*a) for a in json.loads(args.loras)]
    failed: set[int] = set()
    logits, tokens = drive(runner, group, json.loads(args.prompts), args.max_tokens, loras, failed)
    group.send(RankStop())
    group.close()
    torch.save({"logits": logits, "tokens": tokens, "num_kv_blocks": runner.num_kv_blocks,
                "kv_heads": runner.model.num_local_kv_heads, "lora_failed": sorted(failed), **quantized(runner)},
               args.out)
    return 0


if __name__ == "__main__":
    leave(main())  # as the executor stage's ranks end
