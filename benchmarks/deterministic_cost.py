"""What `--deterministic` (batch-invariant steps) costs end to end: served tok/s with and without it.

    python -m benchmarks.deterministic_cost [--concurrency 1 64] [--output-len 128] [--requests 4]

Starts pagedserve on SmolLM2 twice (its defaults, then with `--deterministic`) and runs closed-loop
points of greedy chat requests (ShareGPT first turns or the paper's length histograms over real
prose, as benchmarks.speculative; ignore_eos, fixed output length), C x --requests requests a point.
Prints per concurrency both servers' output tok/s and TPOT p50, and the ratio. Figures, never a
pass/fail: the host may be shared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.speculative import point, sharegpt_requests
from loadgen.peers import launch
from loadgen.targets import Target
from loadgen.tokenizer import tokenizer_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4, help="requests per point and concurrency 1 (C x that at C)")
    parser.add_argument("--log-dir", default="/tmp/pagedserve-bench-deterministic")
    args = parser.parse_args(argv)
    tokenizer = tokenizer_for(args.model)
    requests = sharegpt_requests(tokenizer, args.output_len, max(args.concurrency) * args.requests)
    results: dict[tuple[str, int], dict] = {}
    for name, options in (("default", ()), ("deterministic", ("--deterministic",))):
        with launch.Peer("pagedserve", Path(args.log_dir), options=options, model=args.model, startup_timeout=900.0,
                         log_name=f"deterministic-{name}") as peer:
            target = Target(name=name, url=peer.url, endpoint="chat")
            for c in args.concurrency:
                rec = results[name, c] = point(target, requests[: c * args.requests], c, tokenizer)
                print(f"{name} C={c}: {rec['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    print(f"--deterministic cost, {args.model}, greedy chat, {args.output_len} output tokens (ignore_eos), "
          f"{args.requests} x C requests a point")
    print(f"{'C':>3} {'default tok/s':>14} {'determ. tok/s':>14} {'ratio':>6} {'default TPOT p50':>17} "
          f"{'determ. TPOT p50':>17}")
    for c in args.concurrency:
        d, b = results["default", c], results["deterministic", c]
        print(f"{c:>3} {d['tok_s']:14.1f} {b['tok_s']:14.1f} {b['tok_s'] / d['tok_s']:6.2f} "
              f"{1e3 * (d['tpot_p50'] or 0):15.1f}ms {1e3 * (b['tpot_p50'] or 0):15.1f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
