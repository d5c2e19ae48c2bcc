"""Decode attention read from DRAM: 30 layers of the C++ paged attention, L3 flushed between repeats.

Each layer has its own K/V pool (SmolLM2's shape: 9 query heads, 3 KV heads, head_dim 64,
blocks of 16 tokens placed at random), so that a step reads its KV from memory as a served
model's decode step does, not from the cache a previous call left warm. Prints the median
time of the 30 layers per shape (sequences x context tokens) and a checksum of the output.

`--so PATH` loads another build of the extension (a `pagedserve_cpu_*.so` from
~/.cache/pagedserve/extensions, e.g. the one built before a change): run it and the current
build in turn, alternating, in separate processes (both register the same torch ops), and
compare medians; equal checksums mean bit-identical outputs.

    python -m benchmarks.decode_attention_dram --shapes 64x200 32x400 16x1000 1x8000
    python -m benchmarks.decode_attention_dram --so ~/.cache/pagedserve/extensions/X/X.so

Figures only; never a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def load_extension(so: str | None):
    if so is None:
        from kernels.cpu.build import load

        ext = load()
        if ext is None:
            raise SystemExit("the C++ CPU kernels did not build here")
        return ext
    path = Path(so).expanduser()
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_shape(ext, seqs: int, ctx: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Median ms of 30 layers' decode attention for `seqs` sequences of `ctx` tokens, and a checksum."""
    per_seq = -(-ctx // BLOCK)
    pool = seqs * per_seq + 8
    k_caches = [torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    v_caches = [torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(pool)[: seqs * per_seq].view(seqs, per_seq).to(torch.int32)
    query = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    starts = torch.arange(seqs + 1, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    out = torch.empty_like(query)
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # larger than any L3 here
    times = []
    for _ in range(repeats + 2):
        flush.add_(1)
        t = time.perf_counter()
        for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
            ext.paged_attention(out, query, k_cache, v_cache, tables, starts, lens, HEAD_DIM**-0.5, 0)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e3, out.float().sum().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["64x200", "32x400", "16x1000", "8x4000", "1x8000"],
                        help="SEQSxTOKENS")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--so", help="another build of the extension to time instead of this checkout's")
    args = parser.parse_args()
    torch.manual_seed(0)
    ext = load_extension(args.so)
    dtype = getattr(torch, args.dtype)
    print(f"decode attention from DRAM, {LAYERS} layers, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{args.so or 'this checkout'}")
    for shape in args.shapes:
        seqs, ctx = (int(v) for v in shape.split("x"))
        ms, checksum = time_shape(ext, seqs, ctx, dtype, args.repeats)
        print(f"  {seqs:3d} x {ctx:6d}: {ms:8.2f} ms  checksum {checksum:.4f}", flush=True)


if __name__ == "__main__":
    main()
