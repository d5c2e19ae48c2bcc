"""A LoRA adapter's share on one tensor-parallel rank, cut as the base model is
(`models.sharding.ModelShard`, the same ranges `LlamaForCausalLM._shard_of` copies).

Column-parallel projections (the fused q/k/v and gate/up) keep A whole and the rows of B
that produce the rank's outputs, in the fused order of the rank's base weight (its query
heads, then its KV heads' k, then their v; its gate columns, then its up columns): the
rank's delta is the exact delta of its own output columns. Row-parallel projections (o,
down) keep the columns of A that read the rank's input share, and B whole: the rank's
delta x_i A_i^T B^T is a partial sum, added into the rank's partial output before the
layer's all-reduce, which sums the ranks' parts into the exact x A^T B^T.

Every rank keeps the full rank of every adapter (A's rows), so rank limits and the slot
table's regions are the same on every rank; only the in/out sizes differ.
"""

from __future__ import annotations

import torch

from kernels.lora import LoraTarget
from services.executor.lora_weights import LayerLora, LoraWeights
from services.executor.models.sharding import ModelShard
from shared.lora_files import BaseShapes


def shard_lora(weights: LoraWeights, shard: ModelShard, head_dim: int, base: BaseShapes) -> LoraWeights:
    """This rank's part of a whole adapter (the adapter itself for a group of one)."""
    if shard.size == 1:
        return weights
    q_size, kv_size = base.projections["q_proj"][1], base.projections["k_proj"][1]
    inter = base.projections["gate_proj"][1]
    q = range(shard.q_heads.start * head_dim, shard.q_heads.stop * head_dim)
    kv = range(shard.kv_heads.start * head_dim, shard.kv_heads.stop * head_dim)
    qkv_rows = [q, _shift(kv, q_size), _shift(kv, q_size + kv_size)]
    gate_up_rows = [shard.intermediate, _shift(shard.intermediate, inter)]
    layers, nbytes = [], 0
    for layer in weights.layers:
        parts = LayerLora(_column_parallel(layer.qkv, qkv_rows), _row_parallel(layer.o, q),
                          _column_parallel(layer.gate_up, gate_up_rows), _row_parallel(layer.down, shard.intermediate))
        nbytes += sum((t.a.numel() + t.b.numel()) * t.a.element_size() for t in parts if t is not None)
        layers.append(parts)
    return weights._replace(layers=layers, nbytes=nbytes)


def _shift(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


def _column_parallel(target: LoraTarget | None, rows: list[range]) -> LoraTarget | None:
    """A whole; B's output rows in `rows` (global indices, in this rank's fused order)."""
    if target is None:
        return None
    b = torch.cat([target.b[r.start : r.stop] for r in rows]).contiguous()
    return LoraTarget(target.a, b, None if target.blocks is None else _local_blocks(target.blocks, rows))


def _row_parallel(target: LoraTarget | None, cols: range) -> LoraTarget | None:
    """A's input columns in `cols`; B whole (its blocks are about outputs, which every rank has all of)."""
    if target is None:
        return None
    return LoraTarget(target.a[:, cols.start : cols.stop].contiguous(), target.b, target.blocks)


def _local_blocks(blocks: torch.Tensor, rows: list[range]) -> torch.Tensor:
    """Blocks (c0, c1, n0, n1) over the whole output, over the kept rows instead: each block's
    outputs that survive, as one range of the concatenated rows (an empty one if none do)."""
    out = []
    for c0, c1, n0, n1 in blocks.tolist():
        local, offset = [], 0
        for r in rows:
            lo, hi = max(n0, r.start), min(n1, r.stop)
            if lo < hi:
                local += [offset + lo - r.start, offset + hi - r.start]
            offset += len(r)
        out.append([c0, c1, min(local), max(local)] if local else [c0, c1, 0, 0])
    return torch.tensor(out, dtype=torch.long).view(-1, 4)
