"""Batched LoRA deltas over a step whose rows run under different adapters (and the base model).

The base projection runs once over every row (`out = x @ W^T`); then each adapter adds its
low-rank delta to its own rows only: out[rows] += x[rows] @ A^T @ B^T, the scaling folded
into B. A `LoraTarget` is one of the model's fused projections (q/k/v, o, gate/up, down)
under one adapter: A stacks the A of its parts ([sum of ranks, in]); B is block-diagonal
([out, sum of ranks], zero where a part's rows meet another part's ranks, zero rows for a
part the adapter does not target), so a fused projection's delta is two matmuls whatever
its parts.

`add_lora` is the segmented form: rows grouped by adapter, one shrink and one expand matmul
per group (a slice when a group's rows are contiguous, else a gather and an index_add).
`add_lora_reference` is the plain form it is tested against: row by row, with each part's
merged weight delta B @ A as PEFT's merge computes it. The kernels (C++ on the CPU, Triton on
CUDA: `kernels.lora_stacked`, `kernels.lora_triton`) take the slots' targets stacked and the
rows grouped by slot, and are tested against the same reference (see the README's LoRA section).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LoraTarget:
    a: Tensor  # [sum of ranks, in_features]
    b: Tensor  # [out_features, sum of ranks], block-diagonal over the parts, scaling folded in
    # [parts, 4] int64 (c0, c1, n0, n1): B's columns [c0, c1) are zero outside rows [n0, n1) (None: not known)
    blocks: Tensor | None = None


Rows = slice | Tensor  # a group's token rows


def add_lora(x: Tensor, out: Tensor, groups: list[tuple[Rows, LoraTarget | None]]) -> None:
    """out[rows] += x[rows] @ a^T @ b^T for each group, in place (a None target: the adapter leaves
    this projection alone)."""
    for rows, target in groups:
        if target is None:
            continue
        if isinstance(rows, slice):
            out[rows].addmm_(x[rows] @ target.a.t(), target.b.t())
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ target.a.t()) @ target.b.t())


def add_lora_reference(x: Tensor, out: Tensor, row_targets: list[LoraTarget | None]) -> None:
    """The same, one row at a time through the merged delta B @ A (row i under row_targets[i])."""
    for i, target in enumerate(row_targets):
        if target is not None:
            out[i] += (target.b.double() @ target.a.double()).to(out.dtype) @ x[i]


def row_groups(row_slots: list[int], device: torch.device | str = "cpu") -> list[tuple[int, Rows]]:
    """Token rows grouped by slot ((slot, rows) in slot order; -1, the base model, left out): a
    slice where a slot's rows are contiguous, else a long tensor of them."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    out: list[tuple[int, Rows]] = []
    for slot in sorted(by_slot):
        rows = by_slot[slot]
        if rows[-1] - rows[0] + 1 == len(rows):
            out.append((slot, slice(rows[0], rows[-1] + 1)))
        else:
            out.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
    return out
