"""`--deterministic`: forward passes whose every row is computed the same way whatever the step holds.

Without it a token's logits depend on what shares its step, because two ops pick their
kernel by the step's row count M:

- the quantized copies serve steps of at most a calibrated number of rows, dense weights
  the larger ones (`quantization`, `step_calibration`): another kernel, other rounding;
- torch's dense matmul (oneDNN) itself: on an AMX Xeon, row i of `F.linear(x, w)` differs
  bitwise from `F.linear(x[i:i+1], w)` for every M >= 2 in float32 and for most M >= 33 in
  bfloat16, at 1 or 2 threads alike. Called on exactly T rows it is row-independent: a
  row's result is the same at any position of the tile and whatever the other rows hold.

The mode fixes one path per linear, the same for every row count:

- a decoder linear or head whose quantized copy runs by the C++ `q4_linear` or `q8_linear`
  (`Q4Weight`, `Q8Weight`) keeps that copy for every step, by the integer kernel alone (not
  `q4_linear_tiles`, which serves large steps otherwise): it quantizes each input row on its own and
  sums each output over its groups in one fixed order, split over threads by output columns
  only, so a row's result depends on nothing else (nor on the thread count);
- every other linear (no quantized copy, or torch's int4/int8 kernels, whose blocking is
  not ours) runs dense through `tiled_linear`: its rows padded with zeros to a multiple of
  `TILE_ROWS` and multiplied TILE_ROWS at a time.

- paged attention runs the C++ kernel for every row (the backend's
  `row_invariant_paged_attention`), never the SDPA path the CPU backend takes for long
  chunks (`kernels.cpu.dense_attention`), whose result depends on the chunk's length.

What is already row-independent stays as it is: the embedding, the C++ RMSNorm, RoPE and
SiLU kernels (one row at a time), the C++ paged attention (one sequence per work item,
each query row's keys visited block by block in position order whatever the chunk or
the batch), log_softmax and top-k (per row), numpy's argmax (the first maximum).
torch.compile's decode graphs (one per padded batch size) are turned off.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from services.executor.quantization import ALL_ROWS, Q4Weight, Q8Weight

# rows per dense matmul call. Median of 9 over SmolLM2's 120 decoder matmuls (bfloat16, AMX, 2 threads):
# 1 row: 27 ms (T=16), 30 (32), 37 (64); 64 rows: 80, 62, 45; 256 rows: 249, 155, 105
TILE_ROWS = 64


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, tile: int = TILE_ROWS) -> Tensor:
    """F.linear(x, weight, bias) computed `tile` rows per call (the last tile padded with zeros), so
    that each row's reduction order is the one of a `tile`-row matmul whatever x's row count."""
    m = x.shape[0]
    if m == tile:
        return F.linear(x, weight, bias)
    pad = -m % tile
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    out = torch.cat([F.linear(t, weight, bias) for t in x.split(tile)]) if m else F.linear(x, weight, bias)
    return out[:m] if pad else out


def make_batch_invariant(model, tile: int = TILE_ROWS) -> list[str]:
    """Give every linear of `model` (a LlamaForCausalLM) and its head one path for all row counts;
    returns what was chosen, for the log."""
    kept = tiled = 0
    for linear in model.decoder_linears():
        if type(linear.int4) is Q4Weight:
            linear.int4.max_rows = linear.int4.tiles_from = ALL_ROWS
            kept += 1
        else:
            linear.int4, linear.tile_rows = None, tile
            tiled += 1
    lines = [f"deterministic: {kept} decoder linears on their q4_linear copies for every step, "
             f"{tiled} dense in tiles of {tile} rows"]
    if type(model.head_int8) is Q8Weight:
        model.head_int8.max_rows = model.head_int8.tiles_from = ALL_ROWS
        lines.append("deterministic: the head on its int8 (q8_linear) copy for every step")
    else:
        model.head_int8, model.head_tile_rows = None, tile
        lines.append(f"deterministic: the head dense in tiles of {tile} rows")
    invariant = model.backend.row_invariant_paged_attention
    if invariant is not None:
        model.backend = dataclasses.replace(model.backend, paged_attention=invariant)
        lines.append(f"deterministic: the {model.backend.name!r} backend's paged attention by its one kernel "
                     "for every chunk length")
    if model.backend.name != "cpu":
        lines.append(f"deterministic: the {model.backend.name!r} attention backend is not batch-invariant "
                     "(it batches decode rows padded to the longest context); only 'cpu' is")
    return lines
