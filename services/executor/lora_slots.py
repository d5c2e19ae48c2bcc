"""The executor's LoRA adapters: `max_loras` slots, each holding one adapter's weights on the
device, filled from a host LRU of `max_cpu_loras` loaded adapters.

The scheduler assigns the slots (`services.scheduler.lora_slots`) and every step names the
adapter of each slot its rows use (`ExecuteStep.lora_slots`); `prepare` makes the slots hold
them (from the LRU, else from disk) and groups the step's token rows by slot
(`kernels.lora.row_groups`; for the C++ kernel `StackedLayouts.groups`, long runs of one
adapter left to torch) into a `LoraBatch` the model adds the deltas of. The slots'
weights are also kept stacked (`lora_stack`) for steps that mix adapters or scatter their rows;
a slot change rewrites only that slot's part of the table, so a steady state copies nothing. An adapter that
fails to load fails its rows alone (`LoraBatch.failed`, 400 naming it); those rows run as
the base model meanwhile and their output is dropped. On the CPU a slot shares the host
copy's tensors (no copy).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from kernels.lora import row_groups
from services.executor.lora_batch import LoraBatch
from services.executor.lora_stack import StackedSlots
from services.executor.lora_weights import LayerLora, LoraLoadError, LoraWeights, load_lora
from shared.lora_files import BaseShapes
from shared.lora_options import LoraOptions
from shared.messages import ExecuteStep

log = logging.getLogger(__name__)

# a contiguous run of one adapter's rows (a prompt chunk) at least this long runs by two torch
# matmuls on its slice rather than the C++ kernel: single-threaded on a 2-core AMX Xeon, bfloat16
# SmolLM2 projections at rank 8, the kernel took 1.3x (gate/up) to 0.4x of torch's time at
# 64 rows and 1.5-2.2x at 256
TORCH_RUN_ROWS = 128


class ExecutorLoras:
    def __init__(self, options: LoraOptions, base: BaseShapes, dtype: torch.dtype, device: torch.device,
                 tp_size: int = 1):
        self.options, self.base, self.dtype, self.device, self.tp_size = options, base, dtype, device, tp_size
        self.slots: list[LoraWeights | None] = [None] * options.max_loras
        self.host: OrderedDict[str, LoraWeights] = OrderedDict()  # digest -> weights (on the host)
        self.max_cpu_loras = options.max_cpu_loras or 4 * options.max_loras
        self._stacked: StackedSlots | None = None  # built at the first step with adapter rows
        self._changed: set[int] = set()  # slots refilled since the stacked table last saw them

    def prepare(self, step: ExecuteStep, query_lens: list[int]) -> LoraBatch | None:
        if not step.lora_slots:
            return None
        failed_slots: dict[int, str] = {}
        for slot, adapter in step.lora_slots:
            try:
                self._fill(slot, adapter)
            except LoraLoadError as exc:
                log.warning("%s", exc)
                failed_slots[slot] = str(exc)
        token_slots: list[int] = []
        failed: dict[int, str] = {}
        for i, (seq, n) in enumerate(zip(step.seqs, query_lens, strict=True)):
            slot = seq.lora_slot
            if slot in failed_slots:
                failed[i], slot = failed_slots[slot], -1
            token_slots += [slot] * n
        groups = [(rows, self.slots[slot]) for slot, rows in row_groups(token_slots, self.device)]
        batch = LoraBatch(groups, failed)
        if not groups:
            return batch
        if self._stacked is None:
            self._stacked = StackedSlots(self.slots, self.device, self.dtype)
        elif self._changed:
            self._stacked.update({slot: self.slots[slot] for slot in sorted(self._changed)})
        self._changed.clear()
        stacked = self._stacked
        # the kernel takes any rows in one call; for the torch forms one contiguous group is two
        # matmuls on a slice already: only mixed or scattered rows gain from the stacked form
        if stacked.use_kernel or len(groups) > 1 or not isinstance(groups[0][0], slice):
            batch.stacked = stacked
            if stacked.use_kernel:
                kernel_slots = token_slots
                if len(token_slots) >= TORCH_RUN_ROWS:
                    kernel_slots, batch.runs = self._long_runs(token_slots)
                batch.rows, batch.kernel_groups = stacked.layouts.groups(kernel_slots)
            if stacked.any_torch:
                batch.masks = stacked.layouts.masks(torch.tensor(token_slots, device=self.device), self.dtype)
        return batch

    def _long_runs(self, token_slots: list[int]) -> tuple[list[int], list[tuple[slice, LoraWeights]]]:
        """The runs of at least TORCH_RUN_ROWS rows of one slot (as slices, with their weights) and
        the rows' slots with those runs taken out (-1) for the kernel."""
        kernel_slots, runs, begin = list(token_slots), [], 0
        for i in range(1, len(token_slots) + 1):
            if i == len(token_slots) or token_slots[i] != token_slots[begin]:
                if token_slots[begin] >= 0 and i - begin >= TORCH_RUN_ROWS:
                    runs.append((slice(begin, i), self.slots[token_slots[begin]]))
                    kernel_slots[begin:i] = [-1] * (i - begin)
                begin = i
        return kernel_slots, runs

    def _fill(self, slot: int, adapter) -> None:
        if not 0 <= slot < len(self.slots):
            raise LoraLoadError(f"LoRA slot {slot} is outside this executor's {len(self.slots)} (--max-loras)")
        held = self.slots[slot]
        if held is not None and held.adapter.digest == adapter.digest:
            return
        if self.tp_size > 1:
            raise LoraLoadError("LoRA adapters are not supported under tensor parallelism")
        weights = self.host.get(adapter.digest)
        if weights is None:
            weights = load_lora(adapter, self.base, self.options.max_lora_rank, self.dtype, "cpu")
            log.info("LoRA adapter %s loaded from disk (rank %d, %.1f MiB)", adapter.name, weights.rank,
                     weights.nbytes / 2**20)
            self.host[adapter.digest] = weights
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(adapter.digest)
        self._changed.add(slot)
        self.slots[slot] = weights if self.device.type == "cpu" else _to_device(weights, self.device)


def _to_device(weights: LoraWeights, device: torch.device) -> LoraWeights:
    from kernels.lora import LoraTarget

    def move(t):
        return None if t is None else LoraTarget(t.a.to(device, non_blocking=True), t.b.to(device, non_blocking=True),
                                               t.blocks)

    return weights._replace(layers=[LayerLora(*(move(t) for t in layer)) for layer in weights.layers])
