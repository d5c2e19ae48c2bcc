"""The segmented LoRA delta (`kernels.lora.add_lora`) and the stacked one
(`kernels.lora_stacked`: torch, and the C++ kernel) against their row-by-row reference on ragged
groups: scattered and contiguous rows, empty targets, base rows, block-diagonal B (fused
projections), float32 and bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.lora import LoraTarget, add_lora, add_lora_reference, row_groups
from kernels.lora_stacked import (
    StackedLayouts,
    add_lora_stacked,
    add_lora_stacked_cpu,
    column_blocks,
    cpu_kernel,
    stack_targets,
)


def target(rank: int, fan_in: int, fan_out: int, seed: int, dtype) -> LoraTarget:
    g = torch.Generator().manual_seed(seed)
    return LoraTarget(torch.randn(rank, fan_in, generator=g).to(dtype), torch.randn(fan_out, rank, generator=g).to(dtype))


def fused_target(ranks: list[int], fan_in: int, outs: list[int], seed: int, dtype) -> LoraTarget:
    """A fused projection's target as `lora_weights` builds it: the parts' A stacked, B
    block-diagonal (a part of rank 0: not targeted, zero rows of B)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(ranks), fan_in, generator=g)
    b = torch.zeros(sum(outs), sum(ranks))
    r0 = o0 = 0
    blocks = []
    for r, size in zip(ranks, outs, strict=True):
        b[o0 : o0 + size, r0 : r0 + r] = torch.randn(size, r, generator=g)
        if r:
            blocks.append((r0, r0 + r, o0, o0 + size))
        r0, o0 = r0 + r, o0 + size
    return LoraTarget(a.to(dtype), b.to(dtype), torch.tensor(blocks))


def ragged_case(seed: int, dtype):
    """(x, out, per-slot targets (None: not targeted), each row's slot (-1: base)): ragged ranks,
    contiguous runs for odd seeds, scattered rows for even ones; fused (block-diagonal) targets
    for seeds of 3 and up, whose output sizes are not multiples of a vector."""
    rng = random.Random(seed)
    fan_in, fan_out, num_slots = 48, 80, 5
    if seed >= 3:
        fan_in, outs = 40, [48, 19, 21]
        fan_out = sum(outs)
        targets = [None if s == 3 else fused_target([rng.choice([0, 1, 4, 8]) for _ in outs[:-1]] + [2], fan_in,
                                                    outs, seed * 10 + s, dtype) for s in range(num_slots)]
    else:
        targets = [None if s == 3 else target(rng.choice([1, 4, 8, 24]), fan_in, fan_out, seed * 10 + s, dtype)
                   for s in range(num_slots)]
    rows = rng.randrange(1, 70)
    if seed % 2:  # contiguous runs (prefill chunks)
        row_slots = []
        while len(row_slots) < rows:
            row_slots += [rng.randrange(-1, num_slots)] * rng.randrange(1, 12)
        row_slots = row_slots[:rows]
    else:  # scattered (decode rows in the scheduler's order)
        row_slots = [rng.randrange(-1, num_slots) for _ in range(rows)]
    return torch.randn(rows, fan_in).to(dtype), torch.randn(rows, fan_out).to(dtype), targets, row_slots


def check(got, want, base, targets, row_slots, tol):
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale
    base_rows = [i for i, s in enumerate(row_slots) if s < 0 or targets[s] is None]
    assert torch.equal(got[base_rows], base[base_rows])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("seed", range(6))
def test_grouped_equals_reference_on_ragged_groups(seed, dtype, tol):
    x, base, targets, row_slots = ragged_case(seed, dtype)
    got, want = base.clone(), base.clone()
    add_lora(x, got, [(r, targets[s]) for s, r in row_groups(row_slots)])
    add_lora_reference(x, want, [None if s < 0 else targets[s] for s in row_slots])
    check(got, want, base, targets, row_slots, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("stacked_dtype", [None, torch.float32], ids=["same", "float32"])
@pytest.mark.parametrize("seed", range(6))
def test_stacked_equals_reference_on_ragged_groups(seed, dtype, tol, stacked_dtype):
    x, base, targets, row_slots = ragged_case(seed, dtype)
    layouts = StackedLayouts()
    # every resident slot stacked (the rows use only some), in an order other than the slots'
    stacked = stack_targets([(s, t) for s, t in reversed(list(enumerate(targets))) if t is not None], layouts,
                            stacked_dtype)
    masks = layouts.masks(torch.tensor(row_slots), stacked.a.dtype)
    got, want = base.clone(), base.clone()
    add_lora_stacked(x, got, stacked, masks[stacked.layout])
    add_lora_reference(x, want, [None if s < 0 else targets[s] for s in row_slots])
    check(got, want, base, targets, row_slots, tol)


@pytest.mark.skipif(cpu_kernel() is None, reason="the C++ CPU kernels are not built")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("weights", ["float32", "model"])
@pytest.mark.parametrize("seed", range(8))
def test_cpu_kernel_equals_reference_on_ragged_groups(seed, dtype, tol, weights):
    x, base, targets, row_slots = ragged_case(seed, dtype)
    layouts = StackedLayouts()
    stacked = stack_targets([(s, t) for s, t in reversed(list(enumerate(targets))) if t is not None], layouts,
                            torch.float32 if weights == "float32" else dtype, kernel=True)
    rows, groups = layouts.groups(row_slots)
    got, want = base.clone(), base.clone()
    add_lora_stacked_cpu(x, got, stacked, rows, groups[stacked.layout])
    add_lora_reference(x, want, [None if s < 0 else targets[s] for s in row_slots])
    check(got, want, base, targets, row_slots, tol)
    # strided x and out (a column slice of a wider tensor): the same bits, with no copy of either
    wide_x, wide_out = torch.zeros(x.shape[0], x.shape[1] + 8, dtype=dtype), torch.zeros(
        base.shape[0], base.shape[1] + 16, dtype=dtype)
    wide_x[:, 8:], wide_out[:, :-16] = x, base
    add_lora_stacked_cpu(wide_x[:, 8:], wide_out[:, :-16], stacked, rows, groups[stacked.layout])
    assert torch.equal(wide_out[:, :-16], got)
    assert not wide_out[:, -16:].any()
    # a transposed out takes the same path through a copy
    transposed = base.clone().t().contiguous().t()
    add_lora_stacked_cpu(x, transposed, stacked, rows, groups[stacked.layout])
    assert torch.equal(transposed, got)


@pytest.mark.skipif(cpu_kernel() is None, reason="the C++ CPU kernels are not built")
def test_cpu_kernel_rows_are_independent_of_the_batch():
    """A row's delta is the same bits whatever rows share its tile or its step (a request's output
    must not depend on the batch it runs in)."""
    x, base, targets, row_slots = ragged_case(4, torch.bfloat16)
    layouts = StackedLayouts()
    stacked = stack_targets([(s, t) for s, t in enumerate(targets) if t is not None], layouts, kernel=True)
    rows, groups = layouts.groups(row_slots)
    together = base.clone()
    add_lora_stacked_cpu(x, together, stacked, rows, groups[stacked.layout])
    for i in range(0, len(row_slots), 5):
        alone = base[i : i + 1].clone()
        r, g = layouts.groups(row_slots[i : i + 1])
        add_lora_stacked_cpu(x[i : i + 1], alone, stacked, r, g[stacked.layout])
        assert torch.equal(alone, together[i : i + 1])


def test_column_blocks_skip_the_zero_blocks_of_b():
    t = fused_target([2, 0, 3], 8, [32, 5, 16], 0, torch.float32)
    assert column_blocks(t.b.t().contiguous()).tolist() == t.blocks.tolist() == [[0, 2, 0, 32], [2, 5, 37, 53]]
    t.b[:, 4] = 0  # an all-zero column: an empty range
    assert column_blocks(t.b.t().contiguous()).tolist() == [[0, 2, 0, 32], [2, 4, 37, 53], [4, 5, 0, 0]]
    # stacked: each target's blocks (declared, or found from its B) at its columns
    layouts = StackedLayouts()
    stacked = stack_targets([(0, LoraTarget(t.a, t.b)), (1, fused_target([1, 2, 0], 8, [32, 5, 16], 1,
                                                                          torch.float32))], layouts)
    assert stacked.blocks.tolist() == [[0, 2, 0, 32], [2, 4, 37, 53], [4, 5, 0, 0], [5, 6, 0, 32], [6, 8, 32, 37]]


def test_layouts_are_shared_by_equal_column_slots():
    layouts = StackedLayouts()
    assert layouts.index([(0, 2), (3, 1)]) == layouts.index([(0, 2), (3, 1)]) == 0
    assert layouts.index([(0, 1), (3, 2)]) == 1
    masks = layouts.masks(torch.tensor([3, -1, 0]), torch.float32)
    assert masks[0].tolist() == [[0, 0, 1], [0, 0, 0], [1, 1, 0]]
    rows, groups = layouts.groups([3, -1, 0, 3])
    assert rows.tolist() == [0, 3, 2]
    assert groups[0].tolist() == [[0, 2, 2, 3], [2, 3, 0, 2]]
    assert groups[1].tolist() == [[0, 2, 1, 3], [2, 3, 0, 1]]


def test_row_groups_use_slices_for_contiguous_rows():
    groups = dict(row_groups([2, 2, -1, 0, 2, 1, 1]))
    assert groups[1] == slice(5, 7)
    assert groups[0] == slice(3, 4)
    assert groups[2].tolist() == [0, 1, 4]
    assert -1 not in groups
