"""The executor's stacked LoRA table: per decoder layer and fused projection, the resident
slots' targets side by side (`kernels.lora_stacked`), updated in place when a slot changes.

Each slot owns a region of a projection's stacked A and B^T (`ProjectionTable`), as wide as
the largest rank that slot has held there. A slot taking another adapter writes only its own
region (its new weights, zeros past their rank); only a rank wider than the region regrows
that projection's buffers (copying the other slots' regions once). So a steady state (the
same adapters resident) never copies adapter weights, and a slot change copies one adapter's.
Columns of a region past its adapter's rank are never read by the C++ kernel (a group reads
its slot's live columns only) and are masked out (slot -2, zero weights) in the torch form.

On the CPU with the C++ backend (`USE_CPU_KERNEL`), every projection whose adapters each
have at most `KERNEL_MAX_RANK` columns on it runs by its kernel
(`kernels.lora_stacked.add_lora_stacked_cpu`: each row through its own slot's columns, so
no column is wasted). On CUDA with triton installed (`USE_TRITON_KERNEL`) every projection
runs by the Triton kernels (`kernels.lora_triton`, the same inputs, any rank). Elsewhere
(no C++ backend, no triton, or a switch off) a projection is stacked for the torch
form only while its table's width is at most `MAX_STACKED_FRACTION` of its in_features:
past that the stacked matmuls' wasted columns (each row multiplies every slot's) would cost
more than the grouped form's per-group ops; such a projection keeps the grouped form
(`kernels.lora.add_lora`). The stacked copies are in the model's dtype (on the CPU float32
copies were no faster in a step for bfloat16 models, and twice the bytes; float16 models get
float32 copies where the C++ kernel may run, as it reads float32 or bfloat16).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from kernels.lora import LoraTarget
from kernels.lora_stacked import StackedLayouts, StackedTarget, column_blocks, cpu_kernel, triton_kernel
from services.executor.lora_weights import LoraWeights

# measured on SmolLM2 (in_features 576 and 1536) in bfloat16 on a 2-core AMX Xeon: stacking
# every projection beat the grouped form up to 4 adapters of rank 64 (q/k/v: R = 768 for
# in_features 576) and 16 of rank 8 (benchmarks/lora_step.py, the README's LoRA section)
MAX_STACKED_FRACTION = 2.0
# the C++ kernel for the deltas on the CPU (benchmarks/lora_step.py's `kernel` form against the
# torch forms: the README's LoRA section)
USE_CPU_KERNEL = True
KERNEL_MAX_RANK = 192  # per adapter, on one fused projection (rank 64 on each of q/k/v: 192)
# the Triton kernels for the deltas on CUDA (kernels.lora_triton; no rank limit: they loop over ranks)
USE_TRITON_KERNEL = True
GAP = -2  # the slot of a region's columns past its adapter's rank: matches no row (base rows are -1)


class ProjectionTable:
    """One fused projection of one layer: slot s's columns are [offsets[s], offsets[s] + ranks[s])
    of a [width, in] and bt [width, out], inside its region of caps[s] columns (regions in slot
    order)."""

    def __init__(self, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.caps = [0] * num_slots
        self.ranks = [0] * num_slots
        self.blocks: list[Tensor | None] = [None] * num_slots  # per slot, relative to its region
        self.a: Tensor | None = None
        self.bt: Tensor | None = None
        self.copies = 0  # weight copies made (slot writes and regrowths), for tests and diagnostics

    @property
    def offsets(self) -> list[int]:
        out, begin = [], 0
        for cap in self.caps:
            out.append(begin)
            begin += cap
        return out

    def set(self, changes: dict[int, LoraTarget | None]) -> None:
        """Slot -> its new target on this projection (None: the adapter leaves it alone), each
        written in its slot's region; regions too narrow grow first, all in one reallocation."""
        first = next((t for t in changes.values() if t is not None), None)
        if first is None and self.a is None:
            for slot in changes:
                self.ranks[slot], self.blocks[slot] = 0, None
            return
        if self.a is None:
            self.a = torch.zeros(0, first.a.shape[1], dtype=self.dtype, device=self.device)
            self.bt = torch.zeros(0, first.b.shape[0], dtype=self.dtype, device=self.device)
        caps = [max(cap, 0 if changes.get(s) is None else changes[s].a.shape[0]) if s in changes else cap
                for s, cap in enumerate(self.caps)]
        if caps != self.caps:
            self._regrow(caps, keep=[s for s in range(len(caps)) if s not in changes])
        offsets = self.offsets
        for slot, target in changes.items():
            begin, cap = offsets[slot], self.caps[slot]
            r = 0 if target is None else target.a.shape[0]
            if r:
                self.a[begin : begin + r].copy_(target.a)
                self.bt[begin : begin + r].copy_(target.b.t())
                self.copies += 1
            self.a[begin + r : begin + cap].zero_()
            self.bt[begin + r : begin + cap].zero_()
            self.ranks[slot] = r
            self.blocks[slot] = None if not r else (target.blocks if target.blocks is not None
                                                    else column_blocks(target.b.t()))

    def _regrow(self, caps: list[int], keep: list[int]) -> None:
        """New buffers with regions of caps columns, the live columns of the slots in keep carried over."""
        old_offsets = self.offsets
        width = sum(caps)
        a = torch.zeros(width, self.a.shape[1], dtype=self.dtype, device=self.device)
        bt = torch.zeros(width, self.bt.shape[1], dtype=self.dtype, device=self.device)
        self.caps = caps
        for slot, begin in zip(keep, [self.offsets[s] for s in keep], strict=True):
            r, old = self.ranks[slot], old_offsets[slot]
            if r:
                a[begin : begin + r] = self.a[old : old + r]
                bt[begin : begin + r] = self.bt[old : old + r]
                self.copies += 1
        self.a, self.bt = a, bt

    def parts(self) -> list[tuple[int, int]]:
        """The column layout as (slot, columns) runs: each slot's live columns, then its gap."""
        out = []
        for slot, (cap, r) in enumerate(zip(self.caps, self.ranks, strict=True)):
            out += [(slot, r)] if r else []
            out += [(GAP, cap - r)] if cap > r else []
        return out

    def target(self, layouts: StackedLayouts, kernel_max_rank: int) -> StackedTarget | None:
        """This projection as the step runs it (no weights copied), or None for the grouped form;
        by the kernel if no adapter has more than kernel_max_rank columns on it."""
        live = [r for r in self.ranks if r]
        if not live:
            return None
        kernel = max(live) <= kernel_max_rank
        if not kernel and self.a.shape[0] > MAX_STACKED_FRACTION * self.a.shape[1]:
            return None
        blocks = [b + torch.tensor([begin, begin, 0, 0]) for b, begin in zip(self.blocks, self.offsets, strict=True)
                  if b is not None]
        return StackedTarget(self.a, self.bt, layouts.index(self.parts()), torch.cat(blocks), kernel)


def kernel_of(device: torch.device) -> str | None:
    """The kernel that runs the stacked deltas on device: "cpu" (C++), "triton", or None (torch only)."""
    if device.type == "cpu" and USE_CPU_KERNEL and cpu_kernel() is not None:
        return "cpu"
    if device.type == "cuda" and USE_TRITON_KERNEL and triton_kernel() is not None:
        return "triton"
    return None


class StackedSlots:
    def __init__(self, slots: list[LoraWeights | None], device: torch.device, dtype: torch.dtype):
        self.kernel = kernel_of(device)
        self.use_kernel = self.kernel is not None
        self.kernel_max_rank = {"cpu": KERNEL_MAX_RANK, "triton": sys.maxsize}.get(self.kernel, 0)
        # the C++ kernel reads float32 or bfloat16 weights (float16 models: float32 copies)
        self.dtype = (torch.float32 if self.kernel == "cpu" and dtype not in (torch.float32, torch.bfloat16)
                      else dtype)
        self.device, self.num_slots = device, len(slots)
        self.tables: list[list[ProjectionTable]] = []
        self.layouts = StackedLayouts(device)
        self.layers: list[list[StackedTarget | None]] = []
        self.any_torch = False  # a projection stacked for the torch form (the step needs its masks)
        self.update(dict(enumerate(slots)))

    def update(self, changes: dict[int, LoraWeights | None]) -> None:
        """Slots that now hold other weights (None: empty): each writes its own regions only."""
        num_layers = next((len(w.layers) for w in changes.values() if w is not None), 0)
        while len(self.tables) < num_layers:
            self.tables.append([ProjectionTable(self.num_slots, self.dtype, self.device) for _ in range(4)])
        for i, row in enumerate(self.tables):
            for proj, table in enumerate(row):
                table.set({slot: None if w is None else w.layers[i][proj] for slot, w in changes.items()})
        # fresh layouts (a few small tensors) so old slots' layouts do not pile up in every step's masks
        self.layouts = StackedLayouts(self.device)
        self.layers = [[table.target(self.layouts, self.kernel_max_rank) for table in row] for row in self.tables]
        self.any_torch = any(t is not None and not t.kernel for row in self.layers for t in row)

    @property
    def copies(self) -> int:
        return sum(table.copies for row in self.tables for table in row)
