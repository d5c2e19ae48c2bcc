"""Weight-only 4-bit and 8-bit copies of the weights for small CPU steps (`--quantization`).

A decode step of a few sequences is bound by reading the weights, not by arithmetic,
so quantized weights beat dense bfloat16/float32 there by the ratio of bytes read;
for large batches the dense GEMM wins. A quantized linear therefore keeps both: the
dense weight and a quantized copy, and each call picks by its number of rows
(`max_rows`, measured once at load by `calibrate`: the crossover is the machine's).

- Decoder projections: int4, asymmetric, groups of 32, min/max per group: exactly
  GGUF's Q4_1. With the C++ backend they run by its `q4_linear` (`Q4Weight`: float16
  scale and min where they fit, as GGUF stores them, else float32; the input rows quantized to int8 per group of 32 as llama.cpp does,
  integer dot products; its time hardly grows with the rows, where torch's kernel
  unpacks the weights again for every row). Without it, by torch's
  `_weight_int4pack_mm_for_cpu` (`Int4Weight`: bfloat16 activations; the per-group
  scale and zero rounded to bfloat16, which that kernel takes).
- The output head (the tied embedding, 49152 x 576 in SmolLM2): int8 with a float32
  scale per group of 32, GGUF's Q8_0. With the C++ backend it runs by `q8_linear`
  (`Q8Weight`: the codes + 128 as bytes, w = s * byte - 128 s, q4_linear's integer
  arithmetic with a byte a code; it replaced two 4-bit planes through q4_linear, which
  did every product twice); else by the C++ backend's `int8_group_linear` (`Int8Weight`,
  float32 activations).

A checkpoint converted from a GGUF (the default model) holds dequantized Q4_1/Q8_0
values, so re-quantizing gives back the file's own blocks bit for bit (`on_4bit_grid`,
`on_8bit_grid` check this). `auto` quantizes only such tensors, so the default changes
no model's weights beyond the int4 scales' rounding; `int4` quantizes any checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import reference

log = logging.getLogger(__name__)

GROUP_SIZE = 32
MODES = ("auto", "int4", "none")
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ALL_ROWS = 1 << 30  # a row limit no step reaches: the quantized copy serves every step


def rows_text(max_rows: int, unit: str = "tokens") -> str:
    return "every step" if max_rows >= ALL_ROWS else f"steps of at most {max_rows} {unit}"


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

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


@dataclass
class Q4Weight:
    """Q4_1 weight [out, in] in the C++ kernel's packed layout (kernels.reference.q4_pack): w = d * code + m
    per group of 32, d and m float16 or float32 (`compact_scales`). `op` is the backend's `q4_linear`."""

    packed: Tensor
    d: Tensor
    m: Tensor
    out_features: int
    op: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    max_rows: int = 0
    # the backend's q4_linear_tiles, run for bfloat16 calls of at least tiles_from rows
    tiles: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    tiles_from: int = ALL_ROWS

    def on_tiles(self, x: Tensor) -> bool:
        """Whether a call on x runs on `tiles` (tiles_from is ALL_ROWS where there are none)."""
        return x.shape[0] >= self.tiles_from and x.dtype == torch.bfloat16

    def matmul(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x @ w.T; into out (float32 [rows, out_features]) when given."""
        op = self.tiles if self.on_tiles(x) else self.op
        return op(x, self.packed, self.d, self.m) if out is None else op(x, self.packed, self.d, self.m, out)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.d.nbytes + self.m.nbytes


@dataclass
class Int8Weight:
    """Int8 weight [out, in] with a float32 scale per group of 32 (GGUF Q8_0): w = scale * q.
    `op` is the backend's `int8_group_linear`."""

    qweight: Tensor
    scales: Tensor
    op: Callable[[Tensor, Tensor, Tensor], Tensor]
    max_rows: int = 0

    def matmul(self, x: Tensor) -> Tensor:
        return self.op(x, self.qweight, self.scales)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


@dataclass
class Q8Weight(Q4Weight):
    """Q8_0 weight [out, in] (w = s * c, c in -127..127) as 8-bit codes c + 128 for `q8_linear`
    (kernels.reference.q8_pack): w = s * (c + 128) - 128 s, Q4Weight's arithmetic with a byte a code,
    m left empty (q8_linear's sign for that -128 s, which it adds in its integer dot products).
    `op` is the backend's `q8_linear`; its results are float32 (logits), rounded once."""

    def matmul(self, x: Tensor) -> Tensor:
        return super().matmul(x, torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device))

    @property
    def in_features(self) -> int:
        return self.d.shape[1] * GROUP_SIZE


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


def q8_0_codes(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(codes -127..127, scale) per group of 32, as float32 [out, in/32, 32|1]: weight ~ codes * scale."""
    out_features, in_features = weight.shape
    g = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    scale = g.abs().amax(-1, keepdim=True) / 127
    codes = (g / scale.clamp(min=torch.finfo(torch.float32).tiny)).round().clamp(-127, 127)
    return codes, scale


def on_8bit_grid(weight: Tensor) -> bool:
    """True when every group of 32 is a multiple of its largest magnitude / 127 (a dequantized Q8_0 tensor)."""
    if not quantizable(weight):
        return False
    codes, scale = q8_0_codes(weight)
    return bool(torch.equal((codes * scale).view_as(weight), weight.float()))


def quantize_int8(weight: Tensor, op: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Int8Weight:
    codes, scale = q8_0_codes(weight)
    return Int8Weight(codes.to(torch.int8).flatten(1).contiguous(), scale.squeeze(-1).contiguous(), op)


def quantize_q8(weight: Tensor, op: Callable[..., Tensor], tiles: Callable | None = None,
                tiles_from: int = ALL_ROWS) -> Q8Weight:
    """The weight's Q8_0 blocks as a Q8Weight (a Q8_0-valued tensor round-trips exactly); `tiles`
    (q8_linear_tiles) serves bfloat16 calls of at least `tiles_from` rows where given."""
    codes, scale = q8_0_codes(weight)
    scale = scale.squeeze(-1)
    packed, d, m = reference.q8_pack((codes + 128).to(torch.int64).view(weight.shape), scale, -128 * scale)
    d, m = compact_scales(d, m)
    # no m: q8_linear then adds Q8_0's offset (-128 d) in its integer sums
    return Q8Weight(packed, d, d.new_empty(0), weight.shape[0], op, tiles=tiles,
                    tiles_from=tiles_from if tiles is not None else ALL_ROWS)


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


def compact_scales(d: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """d and m in float16 when that keeps every one to float16's precision (0, or a normal float16:
    GGUF stores Q4_1 and Q8_0 scales so), else in float32 as they are. A decode step reads the
    scales beside the 4-bit codes: float16 ones are 20 bytes a group of 32 weights where float32
    ones are 24 (SmolLM2's decoder: 66 MB a step instead of 79 MB)."""
    both = torch.cat([d.flatten(), m.flatten()]).abs()
    tiny, largest = torch.finfo(torch.float16).tiny, torch.finfo(torch.float16).max
    if bool(((both == 0) | ((both >= tiny) & (both <= largest))).all()):
        return d.to(torch.float16), m.to(torch.float16)
    return d, m


def quantize_q4(weight: Tensor, op: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
                tiles: Callable | None = None, tiles_from: int = ALL_ROWS) -> Q4Weight:
    """The weight's Q4_1 blocks in the C++ kernel's layout, scale and min in float16 where they fit
    (`compact_scales`; float32 otherwise, where a Q4_1-valued tensor round-trips exactly); `tiles`
    (q4_linear_tiles) serves bfloat16 calls of at least `tiles_from` rows where given."""
    codes, scale, low = q4_1_codes(weight)
    packed, d, m = reference.q4_pack(codes.view(weight.shape), scale.squeeze(-1), low.squeeze(-1))
    return Q4Weight(packed, *compact_scales(d, m), weight.shape[0], op,
                    tiles=tiles, tiles_from=tiles_from if tiles is not None else ALL_ROWS)


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
def calibrate(layers: list[tuple[Tensor, Int4Weight | Int8Weight]], dtype: torch.dtype,
              rows: tuple[int, ...] = CALIBRATION_ROWS, reps: int = 5) -> int:
    """Largest row count at which the quantized copies beat the dense weights, timed over every
    layer in turn (so weights stream from memory as in a real step); 0 if never.

    The two paths alternate and each keeps its best time, so other processes starting at
    the same moment (the other stages) slow both alike rather than skewing the choice."""
    best = 0
    for m in rows:
        inputs = [torch.randn(m, w.shape[1], dtype=dtype) for w, _ in layers]

        def dense(inputs=inputs):
            for (w, _), x in zip(layers, inputs, strict=True):
                torch.nn.functional.linear(x, w)

        def quantized(inputs=inputs):
            for (_, q), x in zip(layers, inputs, strict=True):
                q.matmul(x)

        dense(), quantized()  # warm up both paths
        t_dense = t_quant = float("inf")
        for _ in range(reps):
            t_dense, t_quant = min(t_dense, _elapsed(dense)), min(t_quant, _elapsed(quantized))
        log.info("calibration of %s: %d rows: dense %.2f ms, quantized %.2f ms", type(layers[0][1]).__name__, m,
                 t_dense * 1e3, t_quant * 1e3)
        if t_quant >= t_dense:
            break
        best = m
    return best


def int4_copies(model, mode: str, device: torch.device | str) -> tuple[list[Int4Weight | Q4Weight] | None, str]:
    """Int4 copies of the model's decoder linears if `mode` says so, else (None, why not): the C++
    backend's Q4Weight where it offers `q4_linear`, else torch's Int4Weight.

    Call it on the model loaded in float32, before any cast: a cast to bfloat16 moves a
    4-bit checkpoint's values off their grid."""
    weights = [m.weight.data for m in model.decoder_linears()]
    chosen, why = resolve_mode(mode, weights, device)
    if not chosen:
        return None, why
    backend = model.backend
    if backend.q4_linear is not None:
        copies = [quantize_q4(w, backend.q4_linear, backend.q4_linear_tiles, backend.q4_tiles_min_rows)
                  for w in weights]
        tiles = (f", on AMX tiles (q4_linear_tiles) from {backend.q4_tiles_min_rows} rows"
                 if backend.q4_linear_tiles is not None else "")
        return copies, why + "; run by the C++ q4_linear kernel" + tiles
    return [quantize_int4(w) for w in weights], why + "; run by torch's int4 kernel"


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
    mib = sum(c.nbytes for c in copies) / 2**20
    return f"int4 copies of {len(copies)} linears ({mib:.0f} MiB) serve {rows_text(max_rows)}"


def int8_head_copy(model, mode: str, device: torch.device | str) -> tuple[Int8Weight | Q8Weight | None, str]:
    """An int8 copy of the output head (the tied embedding where it is tied) for small steps:
    with `auto` only if the checkpoint holds it as Q8_0 (lossless), always with `int4`.
    Like `int4_copies`, call it on the float32 model, before any cast."""
    weight = model.head_weight().data
    if mode == "none" or not supported(device) or not quantizable(weight):
        return None, "not quantized"
    if mode == "auto" and not on_8bit_grid(weight):
        return None, "the checkpoint's head is not 8-bit; kept dense"
    why = "already 8-bit (Q8_0 groups of 32): int8 loses nothing" if mode == "auto" else "asked for int4"
    backend = model.backend
    if backend.q8_linear is not None:
        tiles = (f", on AMX tiles (q8_linear_tiles) from {backend.q4_tiles_min_rows} rows"
                 if backend.q8_linear_tiles is not None else "")
        return (quantize_q8(weight, backend.q8_linear, backend.q8_linear_tiles, backend.q4_tiles_min_rows),
                why + "; run by the C++ q8_linear kernel" + tiles)
    return quantize_int8(weight, model.backend.int8_group_linear), why


def attach_int8_head(model, copy: Int8Weight | Q8Weight, dtype: torch.dtype, max_rows: int | None = None) -> str:
    """Give the model its head's int8 copy for steps of at most `max_rows` sampled rows (None: measured)."""
    if max_rows is None:
        max_rows = calibrate([(model.head_weight().data, copy)], dtype)
        if max_rows == 0:
            return f"int8 head not used: slower than {str(dtype).removeprefix('torch.')} even for one row"
    copy.max_rows = max_rows
    model.head_int8 = copy
    mib = copy.nbytes / 2**20
    return f"int8 copy of the head ({mib:.0f} MiB) serves {rows_text(max_rows, 'sampled rows')}"
