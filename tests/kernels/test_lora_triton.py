"""The Triton LoRA kernels (`kernels.lora_triton`) against the row-by-row reference
(`kernels.lora.add_lora_reference`) on ragged groups: several adapters of ranks 8 and 16 (and one
slot that leaves the projection alone), base rows untouched, 1 to 70 rows scattered or in runs,
in/out sizes that are not multiples of a block, a fused (block-diagonal) target, in_features
split over several shrink programs, and a strided out. Interpreted on the CPU here
(tests/kernels/conftest.py sets TRITON_INTERPRET=1), compiled on a GPU with TRITON_INTERPRET=0."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from kernels import lora_triton  # noqa: E402
from kernels.lora import LoraTarget, add_lora_reference  # noqa: E402
from kernels.lora_stacked import StackedLayouts, stack_targets  # noqa: E402
from kernels.lora_triton import add_lora_stacked_triton, triton_groups  # noqa: E402
from tests.kernels.paged_batch import DEVICE, INTERPRETED, param_id, runnable  # noqa: E402
from tests.kernels.test_lora_kernel import fused_target  # noqa: E402

pytestmark = runnable

FAN_IN, FAN_OUT = 72, 100  # neither a multiple of BLOCK_K nor of BLOCK_N
# float32 dots are exact float32 either way; float16 rounds the dot inputs on a GPU (s, as torch's form does)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3 if INTERPRETED else 1e-2}


def case(seed: int, rows: int, dtype: torch.dtype, fused: bool):
    """(x, out, per-slot targets (None: the slot's adapter leaves this projection alone), each row's
    slot (-1: base)): runs of one slot for odd seeds, scattered rows for even ones."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    targets = []
    for slot in range(4):
        rank = rng.choice([8, 16])
        if slot == 2:
            targets.append(None)
        elif fused and slot == 1:  # q/k/v-like: three parts, one not targeted
            targets.append(fused_target([rank, 0, 8], FAN_IN, [60, 24, 16], seed * 10 + slot, dtype))
        else:
            targets.append(LoraTarget(torch.randn(rank, FAN_IN, generator=g).to(dtype),
                                      torch.randn(FAN_OUT, rank, generator=g).to(dtype)))
    if seed % 2:
        row_slots = []
        while len(row_slots) < rows:
            row_slots += [rng.randrange(-1, 4)] * rng.randrange(1, 12)
        row_slots = row_slots[:rows]
    else:
        row_slots = [rng.randrange(-1, 4) for _ in range(rows)]
    return torch.randn(rows, FAN_IN, generator=g).to(dtype), torch.randn(rows, FAN_OUT, generator=g).to(dtype), \
        targets, row_slots


def run_kernel(x, out, targets, row_slots):
    layouts = StackedLayouts()
    # stacked in another order than the slots', as the executor's regions may be
    stacked = stack_targets([(s, t) for s, t in reversed(list(enumerate(targets))) if t is not None], layouts)
    stacked = type(stacked)(stacked.a.to(DEVICE), stacked.bt.to(DEVICE), stacked.layout, stacked.blocks, True)
    rows, groups = triton_groups(*layouts.groups(row_slots), torch.device(DEVICE))
    add_lora_stacked_triton(x.to(DEVICE), out, stacked, rows, groups[stacked.layout])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=param_id)
@pytest.mark.parametrize("seed,rows,fused", [(0, 1, False), (1, 37, False), (2, 70, True), (3, 70, False),
                                             (5, 23, True)])
def test_triton_kernel_equals_reference_on_ragged_groups(seed, rows, fused, dtype):
    x, base, targets, row_slots = case(seed, rows, dtype, fused)
    got = run_kernel(x, base.clone().to(DEVICE), targets, row_slots).cpu()
    want = base.clone()
    add_lora_reference(x, want, [None if s < 0 else targets[s] for s in row_slots])
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * scale
    base_rows = [i for i, s in enumerate(row_slots) if s < 0 or targets[s] is None]
    assert torch.equal(got[base_rows], base[base_rows])
    assert not torch.equal(got, base) or not any(s >= 0 and targets[s] is not None for s in row_slots)


def test_split_in_features_and_strided_out(monkeypatch):
    """in_features over three shrink programs (their partial sums added by the expand), and out a
    column slice of a wider tensor (its other columns untouched)."""
    monkeypatch.setattr(lora_triton, "K_PER_SPLIT", 24)
    assert lora_triton.splits_of(FAN_IN) == (2, 64)  # 24 rounds up to one BLOCK_K of 64: 72 = 64 + 8
    monkeypatch.setattr(lora_triton, "BLOCK_K", 16)
    assert lora_triton.splits_of(FAN_IN) == (3, 32)
    x, base, targets, row_slots = case(7, 29, torch.float32, True)
    wide = torch.randn(29, FAN_OUT + 12)
    wide[:, 4 : 4 + FAN_OUT] = base
    got = wide.clone().to(DEVICE)
    run_kernel(x, got[:, 4 : 4 + FAN_OUT], targets, row_slots)
    got = got.cpu()
    want = base.clone()
    add_lora_reference(x, want, [None if s < 0 else targets[s] for s in row_slots])
    assert (got[:, 4 : 4 + FAN_OUT] - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(got[:, :4], wide[:, :4]) and torch.equal(got[:, 4 + FAN_OUT :], wide[:, 4 + FAN_OUT :])


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """(tiny base dir, two adapters of it)."""
    from shared.lora_files import read_adapter
    from shared.messages import LoraAdapter
    from tests.executor.test_model_runner import make_model
    from tests.lora_helpers import make_peft_adapter

    base = tmp_path_factory.mktemp("lora-base")
    make_model(base, "untied")
    adapters = {}
    for name, spec in {"a0": dict(rank=8, seed=1), "a1": dict(rank=16, seed=2, targets=("q_proj", "v_proj",
                                                                                          "down_proj"))}.items():
        path = make_peft_adapter(base, tmp_path_factory.mktemp(name), scale=3.0, **spec)
        adapters[name] = LoraAdapter(name, str(path), read_adapter(path).digest)
    return base, adapters


@pytest.mark.skipif(not INTERPRETED, reason="runs the executor on the CPU, under the interpreter")
def test_executor_adds_its_deltas_by_the_triton_kernel(lora_model, monkeypatch):
    """The executor as on CUDA (`lora_stack.kernel_of` says "triton"): every projection's deltas by
    the kernel, the greedy tokens and logprobs of a batch mixing two adapters and the base those
    of the torch form."""
    from services.executor import lora_batch, lora_stack
    from tests.executor.test_lora import LOGPROB_TOLERANCE, generate, runner

    base, adapters = lora_model
    calls = []

    def counted(*args):
        calls.append(args[2])
        add_lora_stacked_triton(*args)

    monkeypatch.setattr(lora_batch, "triton_kernel", lambda: counted)
    names = ["a0", None, "a1", "a0", "a1"]
    jobs = [(p, adapters[n] if n else None) for p, n in zip([[5, 9, 14], [3, 22], [8, 11, 6, 2], [7], [30, 1]],
                                                            names, strict=True)]
    slots = {"a1": 0, "a0": 2}
    results = {}
    for kernel in ("triton", None):
        monkeypatch.setattr(lora_stack, "kernel_of", lambda device, kernel=kernel: kernel)
        results[kernel] = generate(runner(base), jobs, slots)
    assert calls and all(t.kernel for t in calls)
    assert results["triton"][0] == results[None][0]
    worst = max(abs(a - b) for got, want in zip(results["triton"][1], results[None][1], strict=True)
                for a, b in zip(got, want, strict=True))
    assert worst < LOGPROB_TOLERANCE
