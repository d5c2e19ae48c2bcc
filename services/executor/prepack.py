"""oneDNN-blocked copies of the dense bfloat16/float16 weights, for the CPU's dense matmuls (`--prepack`).

`F.linear` on a bfloat16 CPU tensor reaches oneDNN (AMX or AVX-512 bf16), which reorders
the plain [out, in] weight into its blocked layout on every call. For the step sizes a
server runs (tens to a few hundred rows) that reorder costs about as much as the
arithmetic: with the weight reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`,
the copy inductor's CPU freezing makes) the same matmuls ran 1.3-1.9x faster for 1-214
rows on a 2-core AMX Xeon, one thread, with outputs equal to F.linear's. For whole
prefill chunks (a thousand rows and more) the reorder is amortised and the two were even,
so calls above `max_rows` keep F.linear.

The packed copy is kept beside the dense weight (which the int4 calibration, LoRA,
--compile and --deterministic still read): it costs the weights' bytes once more. Float32
is never packed, so the exact mode (`--dtype float32 --quantization none`) keeps its
kernels and outputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)
# oneDNN picks its kernel by the row count it is told at the reorder; measured fastest near a step's size
PACK_ROWS_HINT = 512
PACKED_MAX_ROWS = 512  # calls of more rows take F.linear (see the module docstring)


@dataclass(frozen=True)
class PackedWeight:
    """A linear's weight in oneDNN's blocked layout, and the calls it serves."""

    packed: Tensor
    bias: Tensor | None
    max_rows: int = PACKED_MAX_ROWS

    def matmul(self, x: Tensor) -> Tensor:
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


def pack(weight: Tensor, bias: Tensor | None = None, max_rows: int = PACKED_MAX_ROWS) -> PackedWeight:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    return PackedWeight(packed, None if bias is None else bias.detach(), max_rows)


def packed_or_dense(packed: PackedWeight | None, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias) through the packed copy where it serves the call, else F.linear."""
    if packed is not None and x.shape[0] <= packed.max_rows and not torch.compiler.is_compiling():
        return packed.matmul(x)
    return F.linear(x, weight, bias)


def attach_packed(model, mode: str = "auto") -> str:
    """Give each decoder linear (and the output head) a packed copy; returns what was done, for the log."""
    dtype, device = model.head_weight().dtype, model.head_weight().device
    if mode == "none":
        return "prepack: none (asked for)"
    why = supported(dtype, device)
    if why is not None:
        return f"prepack: none ({why})"
    linears = model.decoder_linears()
    for linear in linears:
        linear.packed = pack(linear.weight, linear._parameters["bias"])
    model.head_packed = pack(model.head_weight())
    return (f"prepack: {len(linears)} decoder linears and the head in oneDNN's blocked layout for calls of "
            f"at most {PACKED_MAX_ROWS} rows")
