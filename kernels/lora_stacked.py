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

On the CPU, `add_lora_stacked_cpu` runs the same by the C++ backend's `lora_grouped`
(kernels/cpu/csrc/lora.cpp): one call per projection, the step's rows grouped by slot
(`StackedLayouts.groups`), each group through its own slot's columns only (no mask, no
wasted columns), a slot's A and B read once per tile of rows and never the zero blocks of
a fused projection's B (`StackedTarget.blocks`), float32 accumulation. Its reference is
`kernels.lora.add_lora_reference`, as for the torch forms. On CUDA the Triton kernels of
`kernels.lora_triton` (`triton_kernel`) take the same rows and groups.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.lora import LoraTarget


@dataclass(frozen=True)
class StackedTarget:
    a: Tensor  # [R, in_features]: the slots' A, one after another
    bt: Tensor  # [R, out_features]: their B (scaling folded in) matching a's rows, transposed
    layout: int  # index of this target's column slots in its `StackedLayouts`
    blocks: Tensor  # [nb, 4] int64 (c0, c1, n0, n1): columns [c0, c1) of bt are zero outside outputs [n0, n1)
    kernel: bool = False  # run by the executor's kernel (the C++ or the Triton one; else by `add_lora_stacked`)


class StackedLayouts:
    """The distinct column layouts (the slot of each of the R columns) of a stacked table."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device
        self.keys: dict[tuple[tuple[int, int], ...], int] = {}
        self.col_slots: list[Tensor] = []
        self.ranges: list[dict[int, tuple[int, int]]] = []  # per layout: slot -> its columns [begin, end)

    def index(self, parts: list[tuple[int, int]]) -> int:
        """The layout of columns made of (slot, rank) parts in order (added if new); a negative
        slot: columns no row's slot matches."""
        key = tuple(parts)
        found = self.keys.get(key)
        if found is None:
            found = self.keys[key] = len(self.col_slots)
            cols = [slot for slot, rank in parts for _ in range(rank)]
            self.col_slots.append(torch.tensor(cols, dtype=torch.long, device=self.device))
            ranges, begin = {}, 0
            for slot, rank in parts:
                if slot >= 0:  # not a gap (services.executor.lora_stack.GAP)
                    ranges[slot] = (begin, begin + rank)
                begin += rank
            self.ranges.append(ranges)
        return found

    def masks(self, row_slots: Tensor, dtype: torch.dtype) -> list[Tensor]:
        """One [rows, R] mask per layout: 1 where the column's slot is the row's (row_slots: -1
        for a base row, which matches no column)."""
        return [(row_slots[:, None] == cols[None, :]).to(dtype) for cols in self.col_slots]


    def groups(self, row_slots: list[int]) -> tuple[Tensor, list[Tensor]]:
        """The rows for the C++ kernel: the indices of the rows under a slot, grouped by slot (base
        rows left out), and one [groups, 4] int64 tensor per layout: each group's rows [begin, end)
        in those indices and its slot's columns [begin, end) in the layout (empty where the layout
        has no columns of that slot)."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        order, spans = [], []
        for slot, rows in by_slot.items():
            spans.append((slot, len(order), len(order) + len(rows)))
            order += rows
        groups = [torch.tensor([(begin, end, *ranges.get(slot, (0, 0))) for slot, begin, end in spans],
                               dtype=torch.long).view(-1, 4) for ranges in self.ranges]
        return torch.tensor(order, dtype=torch.long), groups


def stack_targets(targets: list[tuple[int, LoraTarget]], layouts: StackedLayouts,
                  dtype: torch.dtype | None = None, kernel: bool = False) -> StackedTarget | None:
    """The (slot, target) pairs of one projection side by side, in `dtype` (theirs if None);
    None if there are none. kernel: for the C++ kernel (CPU tensors, float32 or bfloat16)."""
    if not targets:
        return None
    a = torch.cat([t.a for _, t in targets], 0).to(dtype).contiguous()
    bt = torch.cat([t.b for _, t in targets], 1).t().to(dtype).contiguous()
    blocks, c0 = [], 0
    for _, t in targets:
        own = t.blocks if t.blocks is not None else column_blocks(t.b.t())
        blocks.append(own + torch.tensor([c0, c0, 0, 0]))
        c0 += t.a.shape[0]
    return StackedTarget(a, bt, layouts.index([(slot, t.a.shape[0]) for slot, t in targets]), torch.cat(blocks),
                         kernel)


def column_blocks(bt: Tensor) -> Tensor:
    """[nb, 4] int64 (c0, c1, n0, n1): runs of bt's rows (B's columns) whose non-zeros all lie in
    outputs [n0, n1) (an all-zero column: an empty range), so a kernel skips B's zero blocks."""
    nonzero = bt.ne(0).cpu()
    any_nz = nonzero.any(1)
    n = bt.shape[1]
    first = torch.where(any_nz, nonzero.int().argmax(1), 0)
    last = torch.where(any_nz, n - nonzero.flip(1).int().argmax(1), 0)
    blocks: list[list[int]] = []
    for c, (n0, n1) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        if blocks and blocks[-1][1] == c and blocks[-1][2:] == [n0, n1]:
            blocks[-1][1] = c + 1
        else:
            blocks.append([c, c + 1, n0, n1])
    return torch.tensor(blocks, dtype=torch.long).view(-1, 4)


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
    """The C++ backend's `lora_grouped` (CPU tensors), or None without it."""
    from kernels.cpu.build import load

    ext = load()
    return None if ext is None else getattr(ext, "lora_grouped", None)


@functools.cache
def triton_kernel():
    """`kernels.lora_triton.add_lora_stacked_triton`, or None without the triton package."""
    if importlib.util.find_spec("triton") is None:
        return None
    from kernels.lora_triton import add_lora_stacked_triton

    return add_lora_stacked_triton


def add_lora_stacked_cpu(x: Tensor, out: Tensor, target: StackedTarget, rows: Tensor, groups: Tensor) -> None:
    """The same by the C++ kernel, each group of rows through its own slot's columns only (rows and
    groups: from `StackedLayouts.groups`, the groups of the target's layout; target in float32 or
    bfloat16)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out.stride(-1) == 1:
        cpu_kernel()(out, x, target.a, target.bt, target.blocks, rows, groups)
    else:
        tmp = out.contiguous()
        cpu_kernel()(tmp, x, target.a, target.bt, target.blocks, rows, groups)
        out.copy_(tmp)
