"""GPU check of the Triton kernels and the CUDA executor path, in three parts.

  (a) tests   the kernel tests (tests/kernels) compiled for the GPU, without the interpreter
  (b) decode  paged_attention_decode against torch SDPA (flash) over contiguous K/V:
              batch 8 and 32, contexts 64..4096, head dim 128, GQA 8:1, bfloat16
  (c) serve   SmolLM2 served on the GPU through the whole stack (`pagedserve serve`),
              a short load over HTTP; prints output tokens/s

    python -m kernels.bench                  # all three, on CUDA
    python -m kernels.bench --parts decode   # some of them
    python -m kernels.bench --cpu            # a dry run on the CPU: the same steps on small shapes,
                                             # kernels in Triton's interpreter, serving on the CPU

It exits non-zero when the tests fail or a part cannot run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "decode", "serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true",
                   help="run every part small, on the CPU (kernels interpreted); figures mean nothing")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 8,32; --cpu 2)")
    p.add_argument("--contexts", default=None, help="decode contexts (default 64..4096; --cpu 16,40)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; --cpu 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 4, GQA 8:1; --cpu 1)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; --cpu 64)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--partition", type=int, default=None,
                   help="decode partition tokens (default: heuristic; --cpu 16, so the dry run splits)")
    p.add_argument("--prompts", type=int, default=None, help="serve: requests (default 128; --cpu 4)")
    p.add_argument("--input-len", type=int, default=None, help="serve: prompt tokens (default 256; --cpu 16)")
    p.add_argument("--output-len", type=int, default=None, help="serve: tokens made (default 128; --cpu 8)")
    p.add_argument("--concurrency", type=int, default=None, help="serve: requests in flight (default 64; --cpu 4)")
    p.add_argument("--serve-args", default="", help="more `pagedserve serve` options, e.g. '--no-cuda-graphs'")
    args = p.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    args.heads = args.heads or (8 if args.cpu else 32)
    args.kv_heads = args.kv_heads or (1 if args.cpu else 4)
    args.head_dim = args.head_dim or (64 if args.cpu else 128)
    return args


def _ints(text: str | None, default: list[int]) -> list[int]:
    return default if text is None else [int(x) for x in text.split(",")]


def run_tests(cpu: bool) -> bool:
    print("\n(a) kernel tests " + ("under the interpreter (CPU)" if cpu else "compiled, on the GPU"), flush=True)
    env = {**os.environ, "TRITON_INTERPRET": "1" if cpu else "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0


def run_decode(args, device) -> None:
    import torch

    from kernels import bench_decode

    batches = _ints(args.batches, [2] if args.cpu else [8, 32])
    contexts = _ints(args.contexts, [16, 40] if args.cpu else [64, 128, 256, 512, 1024, 2048, 4096])
    print(f"\n(b) decode attention, {args.heads} query heads : {args.kv_heads} KV heads, head dim {args.head_dim}, "
          f"block size {args.block_size}, bfloat16, on {device}"
          + (" (interpreted: timings mean nothing)" if args.cpu else " (device time, CUDA graphs)"), flush=True)
    print(bench_decode.HEADER, flush=True)
    rows = bench_decode.run(batches, contexts, args.heads, args.kv_heads, args.head_dim, args.block_size,
                            torch.bfloat16, device, partition=args.partition or (16 if args.cpu else None),
                            inner=1 if args.cpu else 20, repeats=1 if args.cpu else 10)
    worst = max(rows, key=lambda r: r.slowdown)
    print(f"worst: batch {worst.batch}, context {worst.context}: paged {worst.slowdown:+.1%} against contiguous",
          flush=True)


def run_serve(args) -> None:
    from kernels import bench_serve

    load = bench_serve.Load(
        prompts=args.prompts or (4 if args.cpu else 128),
        input_len=args.input_len or (16 if args.cpu else 256),
        output_len=args.output_len or (8 if args.cpu else 128),
        concurrency=args.concurrency or (4 if args.cpu else 64),
    )
    device = ["--device", "cpu", "--executor-threads", "2"] if args.cpu else ["--device", "cuda"]
    print(f"\n(c) serving SmolLM2 on {device[1]}, bfloat16", flush=True)
    bench_serve.serve_and_measure(["--dtype", "bfloat16", *device, *args.serve_args.split()], load)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Triton reads this when the kernel modules are imported, which happens below
    os.environ["TRITON_INTERPRET"] = "1" if args.cpu else "0"
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA GPU here; `python -m kernels.bench --cpu` runs the same steps small on the CPU")
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ok = True
    if "tests" in args.parts:
        ok = run_tests(args.cpu)
        print("kernel tests " + ("passed" if ok else "FAILED"), flush=True)
    if "decode" in args.parts:
        run_decode(args, device)
    if "serve" in args.parts:
        run_serve(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
