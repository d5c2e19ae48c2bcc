"""Compiles every Triton kernel launch the wrappers make for an NVIDIA architecture, with no GPU present.

Triton's interpreter checks what a kernel computes but not whether it compiles: types
of loop-carried values, dot shapes, shared memory are checked only by the compiler.
This runs the wrappers on small CPU tensors with launching replaced by compiling
(Triton's own front end and the ptxas its wheel ships), so a CPU machine catches
what would otherwise fail first on a GPU. Needs TRITON_INTERPRET unset or 0.

    python -m kernels.compile_check [--arch 90] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.int64: "i64", torch.int32: "i32"}


def _signature(kernel, args, kwargs) -> tuple[dict, dict]:
    sig, constants = {}, {}
    for name, value in inspect.signature(kernel.fn).bind(*args, **kwargs).arguments.items():
        if kernel.params[kernel.arg_names.index(name)].is_constexpr:
            sig[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot type argument {name}={value!r}")
    return sig, constants


@contextlib.contextmanager
def compiling_instead_of_launching(arch: int, report: Callable[[str, float, int], None]) -> Iterator[None]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", arch, 32)

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        sig, constants = _signature(self, args, kwargs)
        start = time.perf_counter()
        compiled = triton_compile(ASTSource(self, sig, constants), target=target, options=options)
        report(self.fn.__name__, time.perf_counter() - start, compiled.metadata.shared)

    original = JITFunction.run
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def launches(quick: bool) -> Iterator[tuple[str, Callable[[], object]]]:
    """(what, call) for each kernel variant the executor uses."""
    from kernels.cache_ops import copy_blocks, write_kv_to_cache
    from kernels.paged_decode import paged_attention_decode
    from kernels.paged_prefill import paged_prefill_attention

    # (heads, kv heads, head dim): GQA 8:1 at head dim 128, and SmolLM2-135M (GQA 3:1, 64)
    shapes = [(32, 4, 128), (9, 3, 64)]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    # quick: both dot paths (16-bit, and float32 at full precision) and both shapes, once each
    variants = list(zip(dtypes[::2], shapes, strict=True)) if quick else [(d, s) for d in dtypes for s in shapes]
    for dtype, (heads, kv_heads, head_dim) in variants:
        what = f"{heads}:{kv_heads} heads, head dim {head_dim}, {str(dtype).removeprefix('torch.')}"
        q = torch.zeros(8, heads, head_dim, dtype=dtype)
        kv = q[:, :kv_heads]
        cache = torch.zeros(64, 16, kv_heads, head_dim, dtype=dtype)
        tables = torch.zeros(8, 32, dtype=torch.long)
        lens = torch.ones(8, dtype=torch.long)
        starts = torch.arange(9)
        decode = partial(paged_attention_decode, q, cache, cache, tables, lens)
        prefill = partial(paged_prefill_attention, q, cache, cache, tables, starts, lens)
        yield f"decode, one partition, {what}", decode
        yield f"decode, split-K, sliding window, {what}", partial(decode, sliding_window=100, partition=64)
        yield f"prefill, {what}", prefill
        yield f"prefill, sliding window, {what}", partial(prefill, sliding_window=100)
        yield f"write_kv_to_cache, {what}", partial(write_kv_to_cache, kv, kv, cache, cache, lens)
        yield f"copy_blocks, {what}", partial(copy_blocks, [cache], [cache], [(1, 2), (2, 3)])
    yield from lora_launches(dtypes[::2] if quick else dtypes)


def lora_launches(dtypes: list[torch.dtype]) -> Iterator[tuple[str, Callable[[], object]]]:
    """The LoRA kernels (`kernels.lora_triton`): a decode-sized group and a prompt-sized one, rank 8
    and 3 x 64 (a fused q/k/v at rank 64), in_features in one chunk and in several."""
    from kernels.lora_stacked import StackedTarget
    from kernels.lora_triton import TritonGroups, add_lora_stacked_triton

    for dtype in dtypes:
        for in_features, out_features, rank, rows in ((576, 960, 8, 3), (4096, 6144, 192, 300)):
            target = StackedTarget(torch.zeros(2 * rank, in_features, dtype=dtype),
                                   torch.zeros(2 * rank, out_features, dtype=dtype), 0, torch.zeros(0, 4), True)
            groups = TritonGroups(torch.tensor([[0, rows, 0, rank], [rows, 2 * rows, rank, 2 * rank]]), rows, rank)
            x, out = torch.zeros(2 * rows, in_features, dtype=dtype), torch.zeros(2 * rows, out_features, dtype=dtype)
            what = f"{in_features} -> {out_features}, rank {rank}, {rows} rows a group, {str(dtype).removeprefix('torch.')}"
            yield f"lora shrink and expand, {what}", partial(add_lora_stacked_triton, x, out, target,
                                                             torch.arange(2 * rows), groups)


def check(arch: int, quick: bool) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check needs TRITON_INTERPRET unset or 0", file=sys.stderr)
        return 2
    compiled = []

    def report(name, seconds, shared):
        compiled.append(name)
        print(f"    {name}: {seconds:.1f}s, {shared} bytes of shared memory", flush=True)

    failed = 0
    with compiling_instead_of_launching(arch, report):
        for what, call in launches(quick):
            print(f"  {what}", flush=True)
            try:
                call()
            except Exception as exc:  # report every variant, not just the first that fails
                failed += 1
                print(f"    FAILED: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    print(f"{len(compiled)} kernels compiled for sm_{arch}, {failed} launches failed")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100), 90 (H100/H200)")
    p.add_argument("--quick", action="store_true",
                   help="two variants (bfloat16, float32) instead of every dtype and shape")
    args = p.parse_args(argv)
    return check(args.arch, args.quick)


if __name__ == "__main__":
    sys.exit(main())
