"""Eager vs torch.compile'd decode steps (`--compile`), side by side in one process.

One ModelRunner with `compile_decode` (the serving defaults otherwise: dtype auto,
quantization auto, calibrated row limits) runs, per batch size B, decode forward passes
of B sequences of `--context` tokens, each through its own blocks of the pool: first the
compiled bucket's first call (its compile time, and whether inductor's on-disk caches
served it), then `--steps` rounds alternating an eager and a compiled step (so load from
other processes slows both alike). Prints the median of each, the ratio, the compile
time per bucket, and the largest logits difference between the two ways on one step. Run it twice to see a restart served from the cache.

    python -m benchmarks.compile_decode [--model smollm2] [--batches 1 16 64] [--steps 20]
    python -m benchmarks.compile_decode --overhead   # + the per-call cost of the custom-op dispatch
    python -m benchmarks.compile_decode --all-buckets  # + the start-up cost of compiling every bucket
    python -m benchmarks.compile_decode --dynamic    # one graph with a symbolic batch size instead
    python -m benchmarks.compile_decode --cpp-wrapper  # inductor's C++ wrapper instead of its Python one

`--overhead` times many calls of the C++ rms_norm on one row: the pybind function (what
eager steps call), the dispatcher op `torch.ops.pagedserve.rms_norm` (what compiled graphs
call) and the same kernel behind a Python `torch.library.custom_op` (not used: too slow).
Figures only; never a test.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from services.executor.batch import BatchMetadata
from services.executor.compiled_decode import CompiledDecode
from services.executor.model_runner import ModelRunner
from services.executor.step_calibration import decode_step
from shared.model_files import resolve_model


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(runner: ModelRunner, batch: int, context: int, steps: int) -> dict:
    graphs = runner.graphs
    step = decode_step(batch, context, runner.block_size, runner.num_kv_blocks)
    if step is None:
        raise SystemExit(f"the pool of {runner.num_kv_blocks} blocks cannot hold {batch} x {context} tokens")
    meta = BatchMetadata.from_step(step, runner.block_size, runner.num_kv_blocks, runner.device)
    size = graphs.bucket(batch)
    had = size in graphs.compiled

    def eager():
        with torch.inference_mode():
            return runner.model(meta, runner.kv_cache.k_caches, runner.kv_cache.v_caches)

    def compiled():
        return graphs.replay(meta)

    first = _timed(compiled)
    record = graphs.compiled.get(size)
    diff = (compiled() - eager()).abs().max().item()  # the same step both ways (also the warm-up)
    t_eager, t_compiled = [], []
    for _ in range(steps):
        t_eager.append(_timed(eager))
        t_compiled.append(_timed(compiled))
    e, c = statistics.median(t_eager), statistics.median(t_compiled)
    return {"batch": batch, "bucket": size, "eager_ms": e * 1e3, "compiled_ms": c * 1e3, "speedup": e / c, "max_diff": diff,
            "compile_s": None if had else first,
            "cache": "-" if had or record is None else ("hit" if record.cache_hit else "miss"),
            "failed": size in graphs.failed}


def overhead(calls: int = 20000) -> list[tuple[str, float]]:
    """Microseconds per call of the C++ rms_norm on one 576-wide row, three ways."""
    from kernels.cpu.build import load

    ext = load()
    if ext is None:
        return []
    from kernels.cpu.backend import make_backend

    make_backend(ext)
    x, w = torch.randn(1, 576), torch.ones(576)
    out = torch.empty_like(x)

    @torch.library.custom_op("pagedserve_bench::rms_norm", mutates_args=())
    def python_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        o = torch.empty_like(x)
        ext.rms_norm(o, x, weight, eps)
        return o

    dispatcher = torch.ops.pagedserve.rms_norm
    ways = [("pybind ext.rms_norm (eager steps)", lambda: ext.rms_norm(out, x, w, 1e-5)),
            ("dispatcher torch.ops.pagedserve.rms_norm (compiled graphs)", lambda: dispatcher(out, x, w, 1e-5)),
            ("python torch.library.custom_op around it (not used)", lambda: python_op(x, w, 1e-5))]
    result = []
    for name, fn in ways:
        for _ in range(500):
            fn()
        best = min(_timed(lambda fn=fn: [fn() for _ in range(calls)]) for _ in range(5)) / calls
        result.append((name, best * 1e6))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=20, help="timed steps of each kind per batch size")
    p.add_argument("--context", type=int, default=128, help="tokens of context per sequence")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", choices=["auto", "int4", "none"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--overhead", action="store_true", help="also time the custom-op dispatch per call")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="inductor's C++ wrapper (no Python between the graph's kernels; compiles longer)")
    p.add_argument("--all-buckets", action="store_true",
                   help="first compile every bucket up to the largest batch, as a start-up compile would")
    p.add_argument("--dynamic", action="store_true",
                   help="one graph with a symbolic batch size for every bucket instead of one graph per bucket")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.overhead:
        for name, us in overhead():
            print(f"{us:7.2f} us/call  {name}", flush=True)
    start = time.perf_counter()
    runner = ModelRunner(resolve_model(args.model), dtype=args.dtype, quantization=args.quantization,
                         attention_backend=args.attention_backend, max_num_seqs=max(args.batches),
                         compile_decode=True)
    if args.dynamic or args.cpp_wrapper:
        runner.graphs = CompiledDecode(runner.model, runner.kv_cache.k_caches, runner.kv_cache.v_caches,
                                       runner.block_size, runner.max_model_len, max(args.batches),
                                       runner.graphs.scratch_block, dynamic=args.dynamic,
                                       options={"cpp_wrapper": True} if args.cpp_wrapper else None)
    print(f"runner loaded in {time.perf_counter() - start:.1f} s: {runner.dtype}, {runner.backend.name} attention, "
          f"{torch.get_num_threads()} threads, buckets {runner.graphs.sizes}", flush=True)
    if args.all_buckets:
        start = time.perf_counter()
        records = runner.graphs.compile_all()
        print(f"compiled {len(records)} buckets in {time.perf_counter() - start:.1f} s: "
              + ", ".join(f"{r.size}: {r.seconds:.1f} s ({'hit' if r.cache_hit else 'miss'})" for r in records))
    rows = [compare(runner, b, args.context, args.steps) for b in args.batches]
    print(f"\n{'batch':>5} {'bucket':>6} {'eager ms':>9} {'compiled ms':>11} {'speedup':>7} {'compile s':>9} "
          f"{'logits max |diff|':>17} cache")
    for r in rows:
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        print(f"{r['batch']:>5} {r['bucket']:>6} {r['eager_ms']:>9.2f} {r['compiled_ms']:>11.2f} "
              f"{r['speedup']:>6.2f}x {compile_s:>9} {r['max_diff']:>17.2e} {r['cache']}{'  (compile failed: eager)' if r['failed'] else ''}")
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    print(f"dynamo: {counters['stats']['unique_graphs']} graphs, {breaks} graph breaks"
          + (f" ({dict(counters['graph_break'])})" if breaks else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
