"""The engine's own count of verification steps per request under ngram speculation settings.

    python -m benchmarks.ngram_engine_steps [--copy 6] [--sharegpt 4] [--output-len 128]

`benchmarks.ngram_acceptance` replays float32 outputs offline; this runs the real scheduler and
`ModelRunner` (SmolLM2 as served: bfloat16, int4 copies) one request at a time, as at one user,
greedy with ignore_eos, and counts the steps after the prefill: plain decoding, the old ngram
defaults (suffixes 4..1, k 4, every match proposes k) and the new ones (`SpeculativeConfig()`'s).
Steps and tokens are counts, not times; the TPOT ratio over plain weighs each step by
`--cost` as `benchmarks.ngram_acceptance` does. A multi-token step's rows may round differently from
one-token steps (bfloat16, and the int4 copies serve only steps up to their calibrated rows), so
an output may part from plain decoding's at a near tie; the table says how many did.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.ngram_acceptance import DEFAULT_COST
from services.executor.seq_states import SequenceStates
from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from services.scheduler.speculation import SpeculativeConfig
from shared.messages import SamplingParams

CONFIGS = {"plain": SpeculativeConfig(),
           "old: n 4..1, k 4": SpeculativeConfig("ngram", 4, 1, 4, ngram_per_match=0),
           "new default": SpeculativeConfig("ngram")}


def run_one(runner, prompt: list[int], output_len: int, spec: SpeculativeConfig,
            cost: tuple[float, ...]) -> tuple[list[int], int, int, int, float]:
    """(output, decode steps, proposed, accepted, the decode steps' summed cost) of one greedy
    request alone."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_model_len=4096, vocab_size=runner.vocab_size,
                                      speculative=spec), BlockManager(runner.num_kv_blocks, runner.block_size))
    states = SequenceStates()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sched.add_request(Sequence("r", prompt, params, frozenset(), 0.0))
    output: list[int] = []
    steps, total = 0, 0.0
    while (scheduled := sched.schedule()) is not None:
        step, chunks = scheduled
        states.receive(step)
        states.fill(step)
        result = runner.run(step)
        if steps:
            total += cost[len(step.seqs[0].draft_token_ids)]
        for _, delta in sched.process_results(chunks, result.sampled, result.top_logprobs, result.logprobs,
                                              result.prompt_logprobs, result.embeddings, result.num_accepted):
            output.extend(delta.token_ids)
        steps += 1
    stats = sched.stats()
    return (output, steps - 1, stats.spec_decode_num_draft_tokens_total,
            stats.spec_decode_num_accepted_tokens_total, total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--copy", type=int, default=6)
    parser.add_argument("--sharegpt", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cost", type=float, nargs="+", default=list(DEFAULT_COST),
                        help="step(1 + k tokens) / step(1 token) for k = 0.. (benchmarks.verify_cost)")
    args = parser.parse_args(argv)
    from benchmarks.greedy_outputs import chat_ids
    from benchmarks.speculative import copy_requests, sharegpt_requests
    from loadgen.tokenizer import tokenizer_for
    from services.executor.model_runner import ModelRunner
    from shared.model_files import load_tokenizer, resolve_model

    runner = ModelRunner(resolve_model(args.model), num_kv_blocks=512)
    tokenizer, bench_tok = load_tokenizer(args.model), tokenizer_for(args.model)
    sets = {"copy": copy_requests(bench_tok, args.output_len)[: args.copy],
            "sharegpt": sharegpt_requests(bench_tok, args.output_len, args.sharegpt)}
    int4 = next((m.int4.max_rows for m in runner.model.decoder_linears() if m.int4 is not None), 0)
    print(f"{args.model} as served (int4 copies for steps of <= {int4} rows), one request at a time, "
          f"{args.output_len} output tokens; cost(k) = {', '.join(f'{c:.2f}' for c in args.cost)}")
    print("| set | settings | decode steps / request | tokens / step | proposed | accepted | TPOT ratio "
          "| same output as plain |")
    print("|---|---|---|---|---|---|---|---|")
    for name, requests in sets.items():
        if not requests:
            continue
        prompts = [chat_ids(tokenizer, r.prompt) for r in requests]
        plain: list[list[int]] = []
        for label, spec in CONFIGS.items():
            steps = proposed = accepted = same = 0
            total = 0.0
            for i, prompt in enumerate(prompts):
                out, s, p, a, c = run_one(runner, prompt, args.output_len, spec, tuple(args.cost))
                steps, proposed, accepted, total = steps + s, proposed + p, accepted + a, total + c
                if label == "plain":
                    plain.append(out)
                same += out == plain[i]
            tokens = len(prompts) * (args.output_len - 1)
            print(f"| {name} | {label} | {steps / len(prompts):.1f} | {tokens / steps:.2f} | {proposed} | {accepted} "
                  f"| {total / tokens:.2f} | {same} of {len(prompts)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
