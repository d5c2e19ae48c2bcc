"""The executor's stacked LoRA table: per decoder layer and fused projection, the resident
slots' targets side by side (`kernels.lora_stacked`), rebuilt only when a slot changes.

On the CPU with the C++ backend (`USE_CPU_KERNEL`), every projection whose adapters each
have at most `KERNEL_MAX_RANK` columns on it runs by its kernel
(`kernels.lora_stacked.add_lora_stacked_cpu`: each row through its own slot's columns, so
no column is wasted). Elsewhere (CUDA, no C++ backend) a projection is stacked for the torch
form only while the slots' ranks on it sum to at most `MAX_STACKED_FRACTION` of its
in_features: past that the stacked matmuls' wasted columns (each row multiplies every
slot's) would cost more than the grouped form's per-group ops; such a projection keeps the
grouped form (`kernels.lora.add_lora`). The stacked copies are in the model's dtype (on the
CPU float32 copies were no faster in a step for bfloat16 models, and twice the bytes).
"""

from __future__ import annotations

import torch

from kernels.lora_stacked import StackedLayouts, StackedTarget, cpu_kernel, stack_targets
from services.executor.lora_weights import LoraWeights

# measured on SmolLM2 (in_features 576 and 1536) in bfloat16 on a 2-core AMX Xeon: stacking
# every projection beat the grouped form up to 4 adapters of rank 64 (q/k/v: R = 768 for
# in_features 576) and 16 of rank 8 (benchmarks/lora_step.py, the README's LoRA section)
MAX_STACKED_FRACTION = 2.0
# the C++ kernel for the deltas on the CPU (benchmarks/lora_step.py's `kernel` form against the
# torch forms: the README's LoRA section)
USE_CPU_KERNEL = True
KERNEL_MAX_RANK = 192  # per adapter, on one fused projection (rank 64 on each of q/k/v: 192)


class StackedSlots:
    def __init__(self, slots: list[LoraWeights | None], device: torch.device, dtype: torch.dtype):
        self.use_kernel = USE_CPU_KERNEL and device.type == "cpu" and cpu_kernel() is not None
        self.layouts = StackedLayouts(device)
        self.layers: list[list[StackedTarget | None]] = []
        self.any_torch = False  # a projection stacked for the torch form (the step needs its masks)
        resident = [(slot, w) for slot, w in enumerate(slots) if w is not None]
        num_layers = len(resident[0][1].layers) if resident else 0
        for i in range(num_layers):
            row = []
            for proj in range(4):
                targets = [(slot, w.layers[i][proj]) for slot, w in resident if w.layers[i][proj] is not None]
                ranks = [t.a.shape[0] for _, t in targets]
                kernel = self.use_kernel and bool(targets) and max(ranks) <= KERNEL_MAX_RANK
                if not targets or (not kernel and sum(ranks) > MAX_STACKED_FRACTION * targets[0][1].a.shape[1]):
                    row.append(None)
                    continue
                # the kernel reads float32 or bfloat16 weights (float16 models: float32 copies)
                kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
                row.append(stack_targets(targets, self.layouts, kernel_dtype if kernel else dtype, kernel))
                self.any_torch |= not kernel
            self.layers.append(row)
