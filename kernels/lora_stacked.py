"""The stacked LoRA delta: every adapter's delta on one projection in two matmuls.

`kernels.lora.add_lora` runs one shrink and one expand matmul per adapter group, plus a
gather and an index_add where a group's rows are scattered (decode rows, in the
scheduler's order): with 4 adapters that is ~16 small ops per projection, ~2000 a step
of a 30-layer model, each costing more in dispatch than in arithmetic. Here the slots'
targets of one projection sit side by side, A_cat [R, in] (R: the sum of their ranks)
and B_cat [out, R], and a step runs

    s = x @ A_cat^T;  s *= mask;  out += s @ B_cat^T

where mask [rows, R] is 1 where a column belongs to the row's own slot (0 for base rows),
so each row gets only its adapter's delta, whatever the number of adapters. The copies
are kept as A [R, in] and B^T [R, out]. It spends
R / r times the grouped form's flops, which is cheap while R is small beside the
projection's in_features (`services.executor.lora_stack` decides when); masks depend only on
the step's rows and the columns' slots, so one per distinct column layout serves every
layer.

On the CPU, `add_lora_stacked_cpu` runs the same by the C++ backend's `lora_stacked`
(kernels/cpu/csrc/lora.cpp): one call per projection, each row through its own slot's
columns only (no mask, no wasted columns), float32 targets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.lora import LoraTarget


@dataclass(frozen=True)
class StackedTarget:
    a: Tensor  # [R, in_features]: the slots' A, one after another
    bt: Tensor  # [R, out_features]: their B (scaling folded in) matching a's rows, transposed
    layout: int  # index of this target's column slots in its `StackedLayouts`

    @property
    def for_kernel(self) -> bool:
        """Float32 on the CPU: for `add_lora_stacked_cpu`."""
        return self.a.dtype == torch.float32 and self.a.device.type == "cpu" and cpu_kernel() is not None


class StackedLayouts:
    """The distinct column layouts (the slot of each of the R columns) of a stacked table."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device
        self.keys: dict[tuple[tuple[int, int], ...], int] = {}
        self.col_slots: list[Tensor] = []
        self.ranges: list[dict[int, tuple[int, int]]] = []  # per layout: slot -> its columns [begin, end)

    def index(self, parts: list[tuple[int, int]]) -> int:
        """The layout of columns made of (slot, rank) parts in order (added if new)."""
        key = tuple(parts)
        found = self.keys.get(key)
        if found is None:
            found = self.keys[key] = len(self.col_slots)
            cols = [slot for slot, rank in parts for _ in range(rank)]
            self.col_slots.append(torch.tensor(cols, dtype=torch.long, device=self.device))
            ranges, begin = {}, 0
            for slot, rank in parts:
                ranges[slot], begin = (begin, begin + rank), begin + rank
            self.ranges.append(ranges)
        return found

    def masks(self, row_slots: Tensor, dtype: torch.dtype) -> list[Tensor]:
        """One [rows, R] mask per layout: 1 where the column's slot is the row's (row_slots: -1
        for a base row, which matches no column)."""
        return [(row_slots[:, None] == cols[None, :]).to(dtype) for cols in self.col_slots]


    def row_cols(self, row_slots: list[int]) -> list[Tensor]:
        """One [rows, 2] int64 tensor per layout: each row's column range (empty for a base row),
        for the C++ kernel."""
        return [torch.tensor([ranges.get(slot, (0, 0)) for slot in row_slots], dtype=torch.long)
                for ranges in self.ranges]


def stack_targets(targets: list[tuple[int, LoraTarget]], layouts: StackedLayouts,
                  dtype: torch.dtype | None = None) -> StackedTarget | None:
    """The (slot, target) pairs of one projection side by side, in `dtype` (theirs if None);
    None if there are none."""
    if not targets:
        return None
    a = torch.cat([t.a for _, t in targets], 0).to(dtype).contiguous()
    bt = torch.cat([t.b for _, t in targets], 1).t().to(dtype).contiguous()
    return StackedTarget(a, bt, layouts.index([(slot, t.a.shape[0]) for slot, t in targets]))


def add_lora_stacked(x: Tensor, out: Tensor, target: StackedTarget, mask: Tensor) -> None:
    """out += ((x @ a^T) * mask) @ b^T, in place, computed in the target's dtype (mask: the
    layout's, from `StackedLayouts.masks`, in that dtype)."""
    s = torch.mm(x.to(target.a.dtype), target.a.t())
    s.mul_(mask)
    if out.dtype == s.dtype:
        out.addmm_(s, target.bt)
    else:
        out.add_(torch.mm(s, target.bt))


@functools.cache
def cpu_kernel():
    """The C++ backend's `lora_stacked` (float32 targets, CPU tensors), or None without it."""
    from kernels.cpu.build import load

    ext = load()
    return None if ext is None else getattr(ext, "lora_stacked", None)


def add_lora_stacked_cpu(x: Tensor, out: Tensor, target: StackedTarget, cols: Tensor) -> None:
    """The same by the C++ kernel, each row through its own columns only (cols: the layout's,
    from `StackedLayouts.row_cols`; target in float32)."""
    if out.is_contiguous():
        cpu_kernel()(out, x.contiguous(), target.a, target.bt, cols)
    else:
        tmp = out.contiguous()
        cpu_kernel()(tmp, x.contiguous(), target.a, target.bt, cols)
        out.copy_(tmp)
