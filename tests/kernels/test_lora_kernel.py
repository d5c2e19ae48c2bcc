"""The segmented LoRA delta (`kernels.lora.add_lora`) and the stacked one
(`kernels.lora_stacked`: torch, and the C++ kernel) against their row-by-row reference on ragged
groups: scattered and contiguous rows, empty targets, base rows, float32 and bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.lora import LoraTarget, add_lora, add_lora_reference, row_groups
from kernels.lora_stacked import (
    StackedLayouts,
    add_lora_stacked,
    add_lora_stacked_cpu,
    cpu_kernel,
    stack_targets,
)


def target(rank: int, fan_in: int, fan_out: int, seed: int, dtype) -> LoraTarget:
    g = torch.Generator().manual_seed(seed)
    return LoraTarget(torch.randn(rank, fan_in, generator=g).to(dtype), torch.randn(fan_out, rank, generator=g).to(dtype))


def ragged_case(seed: int, dtype):
    """(x, out, per-slot targets (None: not targeted), each row's slot (-1: base)): ragged ranks,
    contiguous runs for odd seeds, scattered rows for even ones."""
    rng = random.Random(seed)
    fan_in, fan_out, num_slots = 48, 80, 5
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
@pytest.mark.parametrize("seed", range(6))
def test_cpu_kernel_equals_reference_on_ragged_groups(seed, dtype, tol):
    x, base, targets, row_slots = ragged_case(seed, dtype)
    layouts = StackedLayouts()
    stacked = stack_targets([(s, t) for s, t in reversed(list(enumerate(targets))) if t is not None], layouts,
                            torch.float32)
    got, want = base.clone(), base.clone()
    add_lora_stacked_cpu(x, got, stacked, layouts.row_cols(row_slots)[stacked.layout])
    add_lora_reference(x, want, [None if s < 0 else targets[s] for s in row_slots])
    check(got, want, base, targets, row_slots, tol)
    strided = base.clone().t().contiguous().t()  # a non-contiguous out takes the same path through a copy
    add_lora_stacked_cpu(x, strided, stacked, layouts.row_cols(row_slots)[stacked.layout])
    assert torch.equal(strided, got)


def test_layouts_are_shared_by_equal_column_slots():
    layouts = StackedLayouts()
    assert layouts.index([(0, 2), (3, 1)]) == layouts.index([(0, 2), (3, 1)]) == 0
    assert layouts.index([(0, 1), (3, 2)]) == 1
    masks = layouts.masks(torch.tensor([3, -1, 0]), torch.float32)
    assert masks[0].tolist() == [[0, 0, 1], [0, 0, 0], [1, 1, 0]]
    assert layouts.row_cols([3, -1, 0])[0].tolist() == [[2, 3], [0, 0], [0, 2]]


def test_row_groups_use_slices_for_contiguous_rows():
    groups = dict(row_groups([2, 2, -1, 0, 2, 1, 1]))
    assert groups[1] == slice(5, 7)
    assert groups[0] == slice(3, 4)
    assert groups[2].tolist() == [0, 1, 4]
    assert -1 not in groups
