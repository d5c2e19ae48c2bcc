"""The C++ int4/int8 matmuls as a decode step runs them: every layer's weights read from DRAM.

`q4_linear` over a model's decoder projections (qkv, o, gate_up, down) for all its layers, each
layer with its own random Q4_1 weights (SmolLM2: 30 layers, 63 MiB; the 1B shape: 16 layers,
580 MiB, both beyond L3), and `q8_linear` over the output head (49,152 x hidden, Q8_0 codes with
float16 scales and no m as served, `--head-explicit-m` for builds that need m;
SmolLM2's head fits a 32 MB L3, so its figure is cached unless a decoder pass runs between).
Prints, per row count, the median ms of one pass, GMAC/s and a checksum.

`--so PATH` loads another build of the extension (a `pagedserve_cpu_*.so` from
~/.cache/pagedserve/extensions, e.g. the one built before a change): run it and this checkout's
build in turn, alternating, in separate processes (both register the same torch ops), and
compare medians; equal checksums mean bit-identical outputs.

    python -m benchmarks.quantized_linear_dram --shape smollm2 --rows 1 8 16 64 214
    python -m benchmarks.quantized_linear_dram --shape 1b --rows 16 166 --head
    python -m benchmarks.quantized_linear_dram --so ~/.cache/pagedserve/extensions/X/X.so
    python -m benchmarks.quantized_linear_dram --tiles --rows 16 28 64 128   # AMX q4_linear_tiles

Figures only; never a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.decode_attention_dram import load_extension
from kernels import reference

# hidden, intermediate, q + k + v rows, layers
SHAPES = {"smollm2": (576, 1536, 576 + 2 * 192, 30), "1b": (2048, 8192, 2048 + 2 * 512, 16)}
VOCAB = 49152


def q4_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k))
    scale = torch.rand(n, k // 32) * 0.01 + 1e-4
    packed, d, m = reference.q4_pack(codes, scale, -8 * scale)
    return packed, d.half(), m.half()  # float16 scales, as the GGUF's (and the served copies')


def time_rows(fn, rows: int, macs: int, out: torch.Tensor, repeats: int) -> str:
    fn()
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    ms = statistics.median(times[1:]) * 1e3
    return f"{ms:9.2f} ms  {rows * macs / ms / 1e6:5.0f} GMAC/s  checksum {out.float().sum().item():.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16, 64, 214])
    parser.add_argument("--head", action="store_true", help="time the output head too")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--so", help="another build of the extension to time instead of this checkout's")
    parser.add_argument("--tiles", action="store_true",
                        help="the decoder by q4_linear_tiles (AMX) instead of q4_linear from --tiles-from rows on")
    parser.add_argument("--tiles-from", type=int, default=None,
                        help="rows from which --tiles applies (default: the build's q4_linear_tiles_rows())")
    parser.add_argument("--head-explicit-m", action="store_true",
                        help="give the head's q8_linear its m (-128 d) as a tensor, as builds before 2026-12-07 need")
    args = parser.parse_args()
    torch.manual_seed(0)
    ext = load_extension(args.so)
    tiles_from = None
    if args.tiles:
        tiles_from = args.tiles_from or ext.q4_linear_tiles_rows()
        if not tiles_from:
            raise SystemExit("--tiles: q4_linear_tiles does not run here (no AMX tiles)")
    hidden, inter, qkv, layers = SHAPES[args.shape]
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    weights = [[q4_weight(n, k) for n, k in shapes] for _ in range(layers)]
    macs = layers * sum(n * k for n, k in shapes)
    tiles = f" (q4_linear_tiles from {tiles_from} rows)" if tiles_from else ""
    print(f"q4_linear{tiles} over {layers} layers of the {args.shape} decoder ({macs * 0.625 / 2**20:.0f} MiB), "
          f"{torch.get_num_threads()} threads, {args.so or 'this checkout'}")
    head = None
    if args.head:
        codes = torch.randint(0, 256, (VOCAB, hidden))
        scale = torch.rand(VOCAB, hidden // 32) * 0.01 + 1e-4
        packed, d, m = reference.q8_pack(codes, scale.half().float(), -128 * scale.half().float())
        # as served (quantization.quantize_q8): float16 scales and no m, Q8_0's -128 d being implied
        head = (packed, d.half(), m.half() if args.head_explicit_m else d.half().new_empty(0))
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (hidden, inter)}
        outs = [torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in shapes]

        op = ext.q4_linear_tiles if tiles_from and rows >= tiles_from else ext.q4_linear

        def decoder(rows=rows, xs=xs, outs=outs, op=op):
            for layer in weights:
                for (_, k), w, out in zip(shapes, layer, outs, strict=True):
                    op(out, xs[k], *w)

        print(f"  decoder {rows:4d} rows: {time_rows(decoder, rows, macs, outs[1], args.repeats)}", flush=True)
        if head is not None:
            logits = torch.empty(rows, VOCAB, dtype=torch.bfloat16)

            def lm_head(logits=logits, x=xs[hidden]):
                ext.q8_linear(logits, x, *head)

            print(f"  head    {rows:4d} rows: {time_rows(lm_head, rows, VOCAB * hidden, logits, args.repeats)}",
                  flush=True)


if __name__ == "__main__":
    main()
