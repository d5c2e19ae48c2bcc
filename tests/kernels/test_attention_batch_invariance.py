"""The C++ paged attention computes each query row the same way, bit for bit, whatever else the call holds:
the same sequence's prompt in one chunk, in other chunks or one token at a time (a replay or a preemption
may chunk it otherwise), and beside other sequences in a batch. `--deterministic` relies on it
(services.executor.deterministic), calling it for every chunk as the backend's `row_invariant_paged_attention`
(its `paged_attention` sends long chunks to SDPA instead, whose bits depend on the chunk). The AVX2 build is checked too, in a child process, where the native
build takes the AVX-512 paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu.backend import backend
from kernels.cpu.build import MARCH_ENV, cpu_flags

ROOT = Path(__file__).resolve().parents[2]
CPU = backend()
pytestmark = pytest.mark.skipif(CPU is None, reason="the C++ CPU kernels did not build")

HEADS, KV_HEADS, D, BS = 4, 2, 64, 16


def pool(ctx: int, dtype: torch.dtype, others: int = 0, seed: int = 0):
    """K/V caches holding a context of ctx tokens on scattered blocks (the first table), plus `others`
    more sequences' tables; the caches are noise throughout."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // BS)
    blocks = per_seq * (1 + others) + 2
    k = torch.randn(blocks, BS, KV_HEADS, D, generator=g).to(dtype)
    v = torch.randn(blocks, BS, KV_HEADS, D, generator=g).to(dtype)
    order = torch.randperm(blocks - 1, generator=g) + 1
    tables = order[: per_seq * (1 + others)].view(1 + others, per_seq)
    return k, v, tables


def attend(q: torch.Tensor, k, v, tables, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """One call over several sequences' chunks (seq index, chunk start, chunk end) -> output rows."""
    rows = torch.cat([q[s][a:b] for s, a, b in chunks])
    qsl = torch.tensor([0] + [b - a for _, a, b in chunks]).cumsum(0)
    ctx = torch.tensor([b for _, _, b in chunks])
    table = torch.stack([tables[s] for s, _, _ in chunks])
    return CPU.row_invariant_paged_attention(rows, k, v, table, qsl, ctx, D**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [45, 64, 83])
def test_a_row_is_the_same_in_any_chunking_and_any_batch(dtype, ctx):
    k, v, tables = pool(ctx, dtype, others=5)
    g = torch.Generator().manual_seed(1)
    q = [torch.randn(ctx, HEADS, D, generator=g).to(dtype) for _ in range(tables.shape[0])]
    whole = attend(q, k, v, tables, [(0, 0, ctx)])
    for cuts in ([0, 7, 30, ctx], [0, 1, 2, 19, 33, ctx], list(range(0, ctx, 5)) + [ctx]):
        parts = [attend(q, k, v, tables, [(0, a, b)]) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert torch.equal(torch.cat(parts), whole), cuts
    one_by_one = torch.cat([attend(q, k, v, tables, [(0, p, p + 1)]) for p in range(ctx)])
    assert torch.equal(one_by_one, whole)
    # the prompt's last 13 rows as a chunk among others' decode rows and prefill chunks
    batch = [(1, 10, 11), (2, 0, 29), (0, ctx - 13, ctx), (3, 40, 41), (4, 3, 17)]
    out = attend(q, k, v, tables, batch)
    assert torch.equal(out[1 + 29 : 1 + 29 + 13], whole[ctx - 13 :])


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the native build already takes the AVX2 paths here")
@pytest.mark.skipif("avx2" not in cpu_flags(), reason="this CPU cannot run an AVX2 build")
@pytest.mark.skipif(os.environ.get(MARCH_ENV) == "haswell", reason="this is the AVX2 run")
def test_the_avx2_build_too():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          cwd=ROOT, env={**os.environ, MARCH_ENV: "haswell"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout, proc.stdout[-1000:]
