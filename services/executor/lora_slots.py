"""The executor's LoRA adapters: `max_loras` slots, each holding one adapter's weights on the
device, filled from a host LRU of `max_cpu_loras` loaded adapters.

The scheduler assigns the slots (`services.scheduler.lora_slots`) and every step names the
adapter of each slot its rows use (`ExecuteStep.lora_slots`); `prepare` makes the slots hold
them (from the LRU, else from disk) and groups the step's token rows by slot
(`kernels.lora.row_groups`; for the C++ kernel `StackedLayouts.groups`, long runs of one
adapter left to torch; for the Triton kernels the same groups on the device) into a
`LoraBatch` the model adds the deltas of. The slots' weights are also kept stacked
(`lora_stack`) for steps that mix adapters or scatter their rows; a slot change rewrites only
that slot's part of the table, so a steady state copies nothing. An adapter that fails to
load fails its rows alone (`LoraBatch.failed`, 400 naming it); those rows run as
the base model meanwhile and their output is dropped. On the CPU a slot shares the host
copy's tensors (no copy).

Under tensor parallelism every rank runs `prepare` on the same step and keeps its share of
each adapter (`lora_shard`; the host LRU holds the shares). The ranks' slot tables must stay
alike, so a step that (re)fills slots ends with the ranks agreeing which fills failed
(`TPGroup.any_flags`): a fill that failed on any rank fails that adapter's rows on every
rank and leaves the slot as it was on all of them, to be tried again by a later step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from kernels.lora import row_groups
from services.executor.lora_batch import LoraBatch
from services.executor.lora_shard import shard_lora
from services.executor.lora_stack import StackedSlots
from services.executor.lora_weights import LayerLora, LoraLoadError, LoraWeights, load_lora
from services.executor.models.sharding import ModelShard
from services.executor.tp_group import TPGroup
from shared.lora_files import BaseShapes
from shared.lora_options import LoraOptions
from shared.messages import ExecuteStep, LoraAdapter

log = logging.getLogger(__name__)

# a contiguous run of one adapter's rows (a prompt chunk) at least this long runs by two torch
# matmuls on its slice rather than the C++ kernel: single-threaded on a 2-core AMX Xeon, bfloat16
# SmolLM2 projections at rank 8, the kernel took 1.3x (gate/up) to 0.4x of torch's time at
# 64 rows and 1.5-2.2x at 256
TORCH_RUN_ROWS = 128


class ExecutorLoras:
    def __init__(self, options: LoraOptions, base: BaseShapes, dtype: torch.dtype, device: torch.device,
                 tp: TPGroup | None = None, shard: ModelShard | None = None, head_dim: int = 0):
        """shard and head_dim: this rank's part of the base model (needed when tp has more than one rank)."""
        self.options, self.base, self.dtype, self.device = options, base, dtype, device
        self.tp, self.shard, self.head_dim = tp or TPGroup.single(), shard, head_dim
        self.slots: list[LoraWeights | None] = [None] * options.max_loras
        self.host: OrderedDict[str, LoraWeights] = OrderedDict()  # digest -> weights (on the host)
        self.max_cpu_loras = options.max_cpu_loras or 4 * options.max_loras
        self._stacked: StackedSlots | None = None  # built at the first step with adapter rows
        self._changed: set[int] = set()  # slots refilled since the stacked table last saw them

    def prepare(self, step: ExecuteStep, query_lens: list[int]) -> LoraBatch | None:
        if not step.lora_slots:
            return None
        failed_slots: dict[int, str] = {}
        fills: list[tuple[int, LoraAdapter, LoraWeights | None]] = []  # (slot, adapter, its weights: None if failed)
        for slot, adapter in step.lora_slots:
            try:
                weights = self._load(slot, adapter)
            except LoraLoadError as exc:
                log.warning("%s", exc)
                failed_slots[slot] = str(exc)
                fills.append((slot, adapter, None))
                continue
            if weights is not None:
                fills.append((slot, adapter, weights))
        # which slots a step refills depends only on the slot tables, alike on every rank
        for (slot, adapter, weights), failed in zip(fills, self.tp.any_flags([w is None for _, _, w in fills]),
                                                    strict=True):
            if weights is None:
                continue
            if failed:
                failed_slots[slot] = (f"LoRA adapter {adapter.name!r} could not be loaded on every tensor-parallel "
                                      f"rank (see the other ranks' logs)")
                continue
            self._changed.add(slot)
            self.slots[slot] = weights
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
            if stacked.kernel == "cpu":
                kernel_slots = token_slots
                if len(token_slots) >= TORCH_RUN_ROWS:
                    kernel_slots, batch.runs = self._long_runs(token_slots)
                batch.rows, batch.kernel_groups = stacked.layouts.groups(kernel_slots)
            elif stacked.kernel == "triton":
                from kernels.lora_triton import triton_groups

                batch.rows, batch.kernel_groups = triton_groups(*stacked.layouts.groups(token_slots), self.device)
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

    def _load(self, slot: int, adapter: LoraAdapter) -> LoraWeights | None:
        """The weights slot is to hold for adapter (this rank's share, on the device; from the host LRU,
        else from disk), or None if it holds them already."""
        if not 0 <= slot < len(self.slots):
            raise LoraLoadError(f"LoRA slot {slot} is outside this executor's {len(self.slots)} (--max-loras)")
        held = self.slots[slot]
        if held is not None and held.adapter.digest == adapter.digest:
            return None
        weights = self.host.get(adapter.digest)
        if weights is None:
            weights = load_lora(adapter, self.base, self.options.max_lora_rank, self.dtype, "cpu")
            if self.tp.size > 1:
                weights = shard_lora(weights, self.shard, self.head_dim, self.base)
            log.info("LoRA adapter %s loaded from disk (rank %d, %.1f MiB)", adapter.name, weights.rank,
                     weights.nbytes / 2**20)
            self.host[adapter.digest] = weights
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(adapter.digest)
        return weights if self.device.type == "cpu" else _to_device(weights, self.device)


def _to_device(weights: LoraWeights, device: torch.device) -> LoraWeights:
    from kernels.lora import LoraTarget

    def move(t):
        return None if t is None else LoraTarget(t.a.to(device, non_blocking=True), t.b.to(device, non_blocking=True),
                                               t.blocks)

    return weights._replace(layers=[LayerLora(*(move(t) for t in layer)) for layer in weights.layers])
