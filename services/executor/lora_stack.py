"""The executor's stacked LoRA table: per decoder layer and fused projection, the resident
slots' targets side by side (`kernels.lora_stacked`), rebuilt only when a slot changes.

A projection is stacked only while the slots' ranks on it sum to at most
`MAX_STACKED_FRACTION` of its in_features: past that the stacked matmuls' wasted
columns (each row multiplies every slot's) would cost more than the grouped form's
per-group ops; such a projection keeps the grouped form (`kernels.lora.add_lora`). The
stacked copies are in the model's dtype (on the CPU float32 copies were no faster in a
step for bfloat16 models, and twice the memory), except those the C++ kernel runs where
`USE_CPU_KERNEL` is set: on the CPU, a projection whose adapters each have at most
`KERNEL_MAX_RANK` columns on it (`kernels.lora_stacked.add_lora_stacked_cpu`, float32).
"""

from __future__ import annotations

import torch

from kernels.lora_stacked import StackedLayouts, StackedTarget, cpu_kernel, stack_targets
from services.executor.lora_weights import LoraWeights

# measured on SmolLM2 (in_features 576 and 1536) in bfloat16 on a 2-core AMX Xeon: stacking
# every projection beat the grouped form up to 4 adapters of rank 64 (q/k/v: R = 768 for
# in_features 576) and 16 of rank 8 (benchmarks/lora_step.py, the README's LoRA section)
MAX_STACKED_FRACTION = 2.0
# the C++ kernel for the stacked delta on the CPU: off, as it did not measurably beat the torch
# form (side by side on a loaded 2-core host: 0.7-1.4x of its time at rank 8, worse at rank 64,
# where it reads a row's adapter columns once per row, with no reuse across rows);
# benchmarks/lora_step.py's `kernel` form measures it
USE_CPU_KERNEL = False
KERNEL_MAX_RANK = 32  # per adapter, on one fused projection (rank 8 on q/k/v: 24)


class StackedSlots:
    def __init__(self, slots: list[LoraWeights | None], device: torch.device, dtype: torch.dtype):
        self.use_kernel = USE_CPU_KERNEL and device.type == "cpu" and cpu_kernel() is not None
        self.layouts = StackedLayouts(device)
        self.layers: list[list[StackedTarget | None]] = []
        resident = [(slot, w) for slot, w in enumerate(slots) if w is not None]
        num_layers = len(resident[0][1].layers) if resident else 0
        for i in range(num_layers):
            row = []
            for proj in range(4):
                targets = [(slot, w.layers[i][proj]) for slot, w in resident if w.layers[i][proj] is not None]
                ranks = [t.a.shape[0] for _, t in targets]
                if not targets or sum(ranks) > MAX_STACKED_FRACTION * targets[0][1].a.shape[1]:
                    row.append(None)
                    continue
                # the C++ kernel takes float32 targets; the torch form runs fastest in the model's dtype
                kernel = self.use_kernel and max(ranks) <= KERNEL_MAX_RANK
                row.append(stack_targets(targets, self.layouts, torch.float32 if kernel else dtype))
            self.layers.append(row)
