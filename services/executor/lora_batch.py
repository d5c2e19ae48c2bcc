"""One step's LoRA deltas, as the model adds them: `LoraBatch` holds the step's row groups by
slot and, where the executor has one, its stacked table and the step's masks;
`LoraBatch.layer(i)` gives layer i's `LayerDeltas`, whose `add(proj, x, out)` adds the
deltas of one fused projection (0 q/k/v, 1 o, 2 gate/up, 3 down: `LayerLora`'s order) by
the C++ kernel where it is built (on the CPU: every step; a long contiguous run of one
adapter's rows, a prompt's, by two matmuls on its slice instead) or the Triton kernels (on
CUDA: every step), else by the stacked torch form
where that projection is stacked and the step mixes adapters or scatters their rows, else
by the grouped form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from kernels.lora import Rows, add_lora
from kernels.lora_stacked import add_lora_stacked, add_lora_stacked_cpu, triton_kernel
from services.executor.lora_stack import StackedSlots
from services.executor.lora_weights import LoraWeights


@dataclass
class LoraBatch:
    """One step's rows under adapters: (rows, that adapter's weights) per slot used, the
    stacked table and its masks for this step's rows (None: grouped only), and the rows
    (indices in step.seqs) whose adapter could not be loaded, with why."""

    groups: list[tuple[Rows, LoraWeights]]
    failed: dict[int, str] = field(default_factory=dict)
    stacked: StackedSlots | None = None
    masks: list[Tensor] | None = None  # per layout, for the torch form
    rows: Tensor | None = None  # for the kernel: the rows under adapters, grouped by slot
    # per layout, for the kernel: its groups of `rows` (Triton: `kernels.lora_triton.TritonGroups`)
    kernel_groups: list | None = None
    runs: list[tuple[slice, LoraWeights]] = field(default_factory=list)  # long runs the kernel leaves to torch

    def layer(self, index: int) -> LayerDeltas | None:
        return LayerDeltas(self, index) if self.groups else None


class LayerDeltas(NamedTuple):
    batch: LoraBatch
    index: int

    def add(self, proj: int, x: Tensor, out: Tensor) -> None:
        batch = self.batch
        if batch.stacked is not None:
            target = batch.stacked.layers[self.index][proj]
            if target is not None:
                if target.kernel:
                    if batch.stacked.kernel == "triton":
                        triton_kernel()(x, out, target, batch.rows, batch.kernel_groups[target.layout])
                    elif len(batch.rows):
                        add_lora_stacked_cpu(x, out, target, batch.rows, batch.kernel_groups[target.layout])
                    if batch.runs:
                        add_lora(x, out, [(rows, weights.layers[self.index][proj]) for rows, weights in batch.runs])
                else:
                    add_lora_stacked(x, out, target, batch.masks[target.layout])
                return
        add_lora(x, out, [(rows, weights.layers[self.index][proj]) for rows, weights in batch.groups])
