"""Weight-only 4-bit linear layers for small CPU batches (`--quantization`).

A decode step of a few sequences is bound by reading the weights, not by arithmetic,
so 4-bit weights (torch's `_weight_int4pack_mm_for_cpu`, bfloat16 activations) beat
dense bfloat16/float32 there by the ratio of bytes read; for large batches the dense
GEMM wins. A quantized linear therefore keeps both: the dense weight and an int4
copy, and each call picks by its number of rows (`Int4Weight.max_rows`, measured
once at load by `calibrate`, since the crossover is a property of the machine).

Quantization is asymmetric, group size 32, min/max per group: exactly GGUF's Q4_1.
A checkpoint converted from a Q4_1 GGUF (the default model) holds dequantized Q4_1
values, so re-quantizing it gives back the file's own 4-bit blocks bit for bit
(`on_4bit_grid` checks this); only the per-group scale and zero are rounded to
bfloat16, which the kernel takes. `auto` quantizes only such checkpoints, so the
default changes no model's weights beyond that rounding; `int4` quantizes any.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)

GROUP_SIZE = 32
MODES = ("auto", "int4", "none")
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Int4Weight:
    """Packed int4 weight [out, in] with per-group bfloat16 (scale, zero) pairs; w = (q - 8) * scale + zero."""

    packed: Tensor
    scales_zeros: Tensor
    out_features: int
    max_rows: int = 0  # calls with at most this many rows use the int4 copy

    def matmul(self, x: Tensor) -> Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_zeros)
        return y.to(x.dtype)


def supported(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def q4_1_codes(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(codes 0..15, scale, min) per group of 32, as float32 [out, in/32, 32|1|1]: weight ~ codes * scale + min."""
    out_features, in_features = weight.shape
    g = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (high - low) / 15
    codes = ((g - low) / scale.clamp(min=torch.finfo(torch.float32).tiny)).round().clamp(0, 15)
    return codes, scale, low


def quantizable(weight: Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % GROUP_SIZE == 0 and weight.shape[0] % 16 == 0


def on_4bit_grid(weight: Tensor) -> bool:
    """True when every group of 32 already holds at most 16 evenly spaced values from its min
    (a dequantized Q4_1 tensor): quantizing it then loses nothing."""
    if not quantizable(weight):
        return False
    codes, scale, low = q4_1_codes(weight)
    return bool(torch.equal((codes * scale + low).view_as(weight), weight.float()))


def quantize_int4(weight: Tensor) -> Int4Weight:
    out_features, in_features = weight.shape
    codes, scale, low = q4_1_codes(weight)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.view(out_features, in_features).to(torch.int32), 1)
    zero = low + 8 * scale
    scales_zeros = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1)
    return Int4Weight(packed, scales_zeros.to(torch.bfloat16).contiguous(), out_features)


def dequantize(w: Int4Weight, codes: Tensor) -> Tensor:
    """The float32 weight an int4 copy stands for, given its codes (for tests and error reports)."""
    scale, zero = w.scales_zeros.float().unbind(-1)  # [in/32, out] each
    return ((codes - 8) * scale.t()[..., None] + zero.t()[..., None]).flatten(1)


def resolve_mode(mode: str, weights: list[Tensor], device: torch.device | str) -> tuple[bool, str]:
    """(quantize?, why) for `--quantization mode` over the model's linear weights."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose from {MODES}")
    if mode == "none":
        return False, "asked for none"
    if not supported(device):
        if mode == "int4":
            raise ValueError(f"--quantization int4 runs on the CPU only, not {torch.device(device).type}")
        return False, f"no int4 kernel on {torch.device(device).type}"
    if not all(quantizable(w) for w in weights):
        if mode == "int4":
            raise ValueError(f"--quantization int4 needs every linear's input size divisible by {GROUP_SIZE}")
        return False, f"some linear's input size is not divisible by {GROUP_SIZE}"
    if mode == "int4":
        return True, "asked for int4"
    if all(on_4bit_grid(w) for w in weights):
        return True, "the checkpoint's weights are already 4-bit (Q4_1 groups of 32): int4 loses nothing"
    return False, "the checkpoint's weights are not 4-bit; --quantization int4 would change them"


def _elapsed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def calibrate(layers: list[tuple[Tensor, Int4Weight]], dtype: torch.dtype,
              rows: tuple[int, ...] = CALIBRATION_ROWS, reps: int = 5) -> int:
    """Largest row count at which the int4 copies beat the dense weights, timed over every
    layer in turn (so weights stream from memory as in a real step); 0 if never.

    The two paths alternate and each keeps its best time, so other processes starting at
    the same moment (the other stages) slow both alike rather than skewing the choice."""
    best = 0
    for m in rows:
        inputs = [torch.randn(m, w.shape[1], dtype=dtype) for w, _ in layers]

        def dense(inputs=inputs):
            for (w, _), x in zip(layers, inputs, strict=True):
                torch.nn.functional.linear(x, w)

        def int4(inputs=inputs):
            for (_, q), x in zip(layers, inputs, strict=True):
                q.matmul(x)

        dense(), int4()  # warm up both paths
        t_dense = t_int4 = float("inf")
        for _ in range(reps):
            t_dense, t_int4 = min(t_dense, _elapsed(dense)), min(t_int4, _elapsed(int4))
        log.info("int4 calibration: %d rows: dense %.2f ms, int4 %.2f ms", m, t_dense * 1e3, t_int4 * 1e3)
        if t_int4 >= t_dense:
            break
        best = m
    return best


def int4_copies(model, mode: str, device: torch.device | str) -> tuple[list[Int4Weight] | None, str]:
    """Int4 copies of the model's decoder linears if `mode` says so, else (None, why not).

    Call it on the model loaded in float32, before any cast: a cast to bfloat16 moves a
    4-bit checkpoint's values off their grid."""
    weights = [m.weight.data for m in model.decoder_linears()]
    chosen, why = resolve_mode(mode, weights, device)
    return ([quantize_int4(w) for w in weights] if chosen else None), why


def attach_int4(model, copies: list[Int4Weight], dtype: torch.dtype, max_rows: int | None = None) -> str:
    """Hand the copies to their linears, used for steps of at most `max_rows` tokens (None: measured
    against the dense weights in `dtype`); returns what was done, for the log."""
    linears = model.decoder_linears()
    if max_rows is None:
        pairs = [(m.weight.data, c) for m, c in zip(linears, copies, strict=True)]
        max_rows = calibrate(pairs, dtype)
        if max_rows == 0:
            return f"int4 not used: slower than {str(dtype).removeprefix('torch.')} even for one row on this machine"
    for module, copy in zip(linears, copies, strict=True):
        copy.max_rows = max_rows
        module.int4 = copy
    mib = sum(c.packed.nbytes + c.scales_zeros.nbytes for c in copies) / 2**20
    return f"int4 copies of {len(copies)} linears ({mib:.0f} MiB) serve steps of at most {max_rows} tokens"
