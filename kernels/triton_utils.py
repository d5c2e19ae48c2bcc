"""Helpers shared by the Triton kernels: sizes, the interpreter check and a dot that works in both modes.

Triton decides at decoration time whether a kernel runs compiled on a GPU or in its
CPU interpreter (TRITON_INTERPRET=1, read when the kernel module is imported). The
interpreter computes a bfloat16 `tl.dot` wrongly, so there every dot runs in
float32; a float32 cache needs full-precision dots anyway (Triton's default is tf32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MIN_DOT = 16  # tl.dot wants every dimension at least this big


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_size(n: int) -> int:
    """A power of two that holds n and that tl.dot accepts."""
    return max(MIN_DOT, next_pow2(n))


def is_interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def dots_in_fp32(kernel, dtype: torch.dtype) -> bool:
    return is_interpreted(kernel) or dtype == torch.float32


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU; a small stand-in elsewhere (the interpreter has no SMs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def dot(a, b, FP32: tl.constexpr):
    """a @ b with a float32 accumulator; a is cast to b's dtype unless FP32 makes both float32."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)
