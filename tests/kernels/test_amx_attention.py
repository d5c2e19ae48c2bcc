"""The AMX chunk attention kernel (csrc/amx_attention.cpp) against its torch reference.

Chunks from position 0 and after earlier context, lengths around the kernel's 16-row tiles and
64-key blocks, scattered block tables with partial last blocks, GQA (SmolLM2's 9/3 and a 1B
Llama's 32/8) and MHA, sliding windows, block sizes 16 and 32, and queries read as a strided
view of a fused QKV row. Outputs are compared with the float32 reference over the same bfloat16
inputs, at the bfloat16 tolerance of the other CPU kernels' tests. Then: the backend routes long
bfloat16 chunks here (bit for bit the direct call), and a bad block table is an error, not a read
out of bounds. Skipped where the CPU has no AMX tiles (e.g. an AVX2 EPYC).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import amx_attention
from kernels.cpu.build import load
from tests.kernels.paged_batch import build

ext = load()
pytestmark = pytest.mark.skipif(not amx_attention.available(ext), reason="no AMX tiles on this CPU (or no extension)")

TOL = dict(atol=1e-2, rtol=2**-7)  # bfloat16, as tests/kernels/test_cpu_kernels.py


def fused_qkv_view(query: torch.Tensor, extra: int) -> torch.Tensor:
    """query's values as a view into wider rows (the model passes q as a slice of the QKV output)."""
    q_len, heads, d = query.shape
    rows = torch.randn(q_len, heads * d + extra).to(query.dtype)
    rows[:, : heads * d] = query.reshape(q_len, -1)
    return rows[:, : heads * d].view(q_len, heads, d)


@pytest.mark.parametrize("ctx,q_len", [(1, 1), (5, 5), (16, 16), (17, 17), (64, 64), (65, 65), (130, 130),
                                       (200, 33), (1000, 128), (300, 1), (129, 64), (640, 320)])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (32, 8)], ids=["gqa3", "mha", "gqa4"])
def test_chunks_match_the_reference(ctx, q_len, heads):
    inputs = build([(ctx, q_len)], *heads, 64, 16, torch.bfloat16, seed=ctx + q_len)
    query = fused_qkv_view(inputs["query"], extra=2 * heads[1] * 64)
    table = inputs["block_tables"][0]
    got = amx_attention.chunk_attention(ext, query, inputs["k_cache"], inputs["v_cache"], table, ctx, 0.125)
    want = amx_attention.reference(query, inputs["k_cache"], inputs["v_cache"], table, ctx, 0.125)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got.float(), want, **TOL)


@pytest.mark.parametrize("window", [1, 5, 64, 100, 5000])
@pytest.mark.parametrize("ctx,q_len", [(300, 300), (500, 200), (77, 40)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_sliding_windows_and_block_sizes(window, ctx, q_len, block_size):
    inputs = build([(ctx, q_len)], 9, 3, 64, block_size, torch.bfloat16, seed=window)
    table = inputs["block_tables"][0]
    args = (inputs["query"], inputs["k_cache"], inputs["v_cache"], table, ctx, 0.125, window)
    got = amx_attention.chunk_attention(ext, *args)
    torch.testing.assert_close(got.float(), amx_attention.reference(*args), **TOL)


def test_the_backend_sends_long_bfloat16_chunks_here():
    from kernels.cpu.backend import make_backend

    inputs = build([(5, 1), (300, 64), (40, 3), (257, 257)], 9, 3, 64, 16, torch.bfloat16, seed=3)
    out = make_backend(ext).paged_attention(**inputs)
    sdpa = make_backend(ext, amx=False).paged_attention(**inputs)
    for i, (start, ctx, q_len) in enumerate([(1, 300, 64), (68, 257, 257)]):
        rows = slice(start, start + q_len)
        table = inputs["block_tables"][[1, 3][i]]
        direct = amx_attention.chunk_attention(ext, inputs["query"][rows], inputs["k_cache"], inputs["v_cache"],
                                               table, ctx, 64**-0.5)
        assert torch.equal(out[rows], direct)
        assert not torch.equal(sdpa[rows], direct)  # the SDPA path is another computation
    # decode rows and short chunks stay on the C++ kernel, identical either way
    assert torch.equal(out[0], sdpa[0]) and torch.equal(out[65:68], sdpa[65:68])


def test_a_bad_block_table_raises():
    inputs = build([(100, 50)], 9, 3, 64, 16, torch.bfloat16)
    table = inputs["block_tables"][0].clone()
    table[2] = inputs["k_cache"].shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        amx_attention.chunk_attention(ext, inputs["query"], inputs["k_cache"], inputs["v_cache"], table, 100, 0.125)
    with pytest.raises(RuntimeError, match="block table too short"):
        amx_attention.chunk_attention(ext, inputs["query"], inputs["k_cache"], inputs["v_cache"], table[:3], 100,
                                      0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx_attention.chunk_attention(ext, inputs["query"].float(), inputs["k_cache"], inputs["v_cache"], table,
                                      100, 0.125)


def test_the_environment_switch_keeps_long_chunks_on_sdpa(monkeypatch):
    from kernels.cpu.backend import DISABLE_AMX_ENV, make_backend

    inputs = build([(300, 64), (5, 1)], 9, 3, 64, 16, torch.bfloat16, seed=5)
    monkeypatch.setenv(DISABLE_AMX_ENV, "1")
    off = make_backend(ext).paged_attention(**inputs)
    assert torch.equal(off, make_backend(ext, amx=False).paged_attention(**inputs))
    monkeypatch.delenv(DISABLE_AMX_ENV)
    assert torch.equal(make_backend(ext).paged_attention(**inputs), make_backend(ext, amx=True).paged_attention(**inputs))
