"""Prepacked copies of the dense bfloat16/float16 weights, for the CPU's dense matmuls (`--prepack`).

On a CPU with AMX tiles a bfloat16 weight is kept in the tile unit's pair-row layout
(`kernels.reference.pack_tiles`) and multiplied by the extension's `bf16_linear_tiles`; elsewhere
(and with `--prepack onednn`) in oneDNN's blocked layout, as below. The tiles copy ran a SmolLM2
layer's four projections (hot in cache, 2 threads, AMX Xeon) in 0.059/0.174/0.317/1.414 ms at
16/64/128/512 rows against oneDNN's packed 0.165/0.275/0.412/1.681 ms: with nothing to reorder and
two output blocks times two row tiles per pass, the tile unit is fed from L1 and L2. From about a
thousand rows oneDNN's F.linear was faster again (1,800 rows: 4.8-5.0 vs 6.6-7.1 ms), so calls above
`max_rows` (512 for oneDNN's copy, 1,024 for the tiles') keep F.linear.

`F.linear` on a bfloat16 CPU tensor reaches oneDNN (AMX or AVX-512 bf16), which reorders
the plain [out, in] weight into its blocked layout on every call. For the step sizes a
server runs (tens to a few hundred rows) that reorder costs about as much as the
arithmetic: with the weight reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`,
the copy inductor's CPU freezing makes) the same matmuls ran 1.3-1.9x faster for 1-214
rows on a 2-core AMX Xeon, one thread, with outputs equal to F.linear's. For whole
prefill chunks (a thousand rows and more) the reorder is amortised and the two were even,
so calls above `max_rows` keep F.linear.

The packed copy (of either kind) is kept beside the dense weight (which the int4 calibration,
LoRA, --compile and --deterministic still read): it costs the weights' bytes once more. Float32
is never packed, so the exact mode (`--dtype float32 --quantization none`) keeps its
kernels and outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.reference import pack_tiles

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)
# oneDNN picks its kernel by the row count it is told at the reorder; measured fastest near a step's size
PACK_ROWS_HINT = 512
PACKED_MAX_ROWS = 512  # calls of more rows take F.linear (see the module docstring)
TILES_MAX_ROWS = 1024  # the same for the tiles' copy
MODES = ("auto", "tiles", "onednn", "none")


@dataclass(frozen=True)
class PackedWeight:
    """A linear's weight in oneDNN's blocked layout, or in the AMX tiles' (`tiles_op` given), and the
    calls it serves."""

    packed: Tensor
    bias: Tensor | None
    max_rows: int = PACKED_MAX_ROWS
    tiles_op: Callable | None = None  # the backend's bf16_linear_tiles, for a pack_tiles copy

    def matmul(self, x: Tensor) -> Tensor:
        if self.tiles_op is not None:
            y = self.tiles_op(x, self.packed)
            return y if self.bias is None else y + self.bias
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def supported(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why packing cannot apply here (None: it can)."""
    if torch.device(device).type != "cpu":
        return "not on the CPU"
    if dtype not in PACKED_DTYPES:
        return f"{dtype} weights (only bfloat16/float16 are packed)"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 kernels for this CPU"
    if dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return "oneDNN has no float16 kernels for this CPU"
    return None


def pack(weight: Tensor, bias: Tensor | None = None, max_rows: int | None = None,
         tiles_op: Callable | None = None) -> PackedWeight:
    """oneDNN's blocked copy, or with `tiles_op` the tiles' (a bfloat16 weight of whole tiles), serving
    calls of at most `max_rows` (default: PACKED_MAX_ROWS, TILES_MAX_ROWS for the tiles)."""
    bias = None if bias is None else bias.detach()
    if tiles_op is not None:
        return PackedWeight(pack_tiles(weight.detach()), bias, max_rows or TILES_MAX_ROWS, tiles_op)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    return PackedWeight(packed, bias, max_rows or PACKED_MAX_ROWS)


def tiles_fit(weight: Tensor) -> bool:
    """Whether bf16_linear_tiles takes this weight: bfloat16, whole 16-output blocks and 32-input groups."""
    return weight.dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0


def packed_or_dense(packed: PackedWeight | None, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias) through the packed copy where it serves the call, else F.linear."""
    if packed is not None and x.shape[0] <= packed.max_rows and not torch.compiler.is_compiling():
        return packed.matmul(x)
    return F.linear(x, weight, bias)


def attach_packed(model, mode: str = "auto") -> str:
    """Give each decoder linear (and the output head) a packed copy; returns what was done, for the log.
    auto: the AMX tiles' layout where the backend offers bf16_linear_tiles (and the weight fits it),
    else oneDNN's; tiles: the tiles' or none; onednn: oneDNN's; none: F.linear only."""
    if mode not in MODES:
        raise ValueError(f"prepack must be one of {MODES}, not {mode!r}")
    dtype, device = model.head_weight().dtype, model.head_weight().device
    if mode == "none":
        return "prepack: none (asked for)"
    tiles_op = getattr(model.backend, "bf16_linear_tiles", None) if mode in ("auto", "tiles") else None
    if tiles_op is not None and (dtype != torch.bfloat16 or torch.device(device).type != "cpu"):
        tiles_op = None
    why = "no AMX tiles kernel for these weights here" if mode == "tiles" else supported(dtype, device)
    if tiles_op is None and why is not None:
        return f"prepack: none ({why})"
    linears = model.decoder_linears()
    kinds: dict[str, int] = {}
    for linear, weight, bias in [(m, m.weight, m._parameters["bias"]) for m in linears] + [(None, model.head_weight(), None)]:
        op = tiles_op if tiles_op is not None and tiles_fit(weight) else None
        if op is None and why is not None:
            continue  # neither kind takes this weight: F.linear
        packed = pack(weight, bias, tiles_op=op)
        kind = "the AMX tiles' pair-row layout (bf16_linear_tiles)" if op is not None else "oneDNN's blocked layout"
        kinds[kind] = packed.max_rows
        if linear is None:
            model.head_packed = packed
        else:
            linear.packed = packed
    return f"prepack: {len(linears)} decoder linears and the head in " + " and ".join(
        f"{kind} for calls of at most {rows} rows" for kind, rows in sorted(kinds.items()))
