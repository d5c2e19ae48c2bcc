"""The chunk attention kernels (csrc/amx_attention.cpp, csrc/avx512_attention.cpp) against their
torch reference.

Chunks from position 0 and after earlier context, lengths around the kernel's 16-row tiles and
64-key blocks, scattered block tables with partial last blocks, GQA (SmolLM2's 9/3 and a 1B
Llama's 32/8) and MHA, sliding windows, block sizes 16 and 32, and queries read as a strided
view of a fused QKV row. Outputs are compared with the float32 reference over the same bfloat16
inputs, at the bfloat16 tolerance of the other CPU kernels' tests. Then: the backend routes long
bfloat16 chunks here (bit for bit the direct call), and a bad block table is an error, not a read
out of bounds. Each kernel's cases are skipped where it does not run (AMX: an AMD EPYC;
AVX512-BF16: an AVX2-only CPU).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import chunk_kernels
from kernels.cpu.build import load
from tests.kernels.paged_batch import build

ext = load()
KERNELS = [pytest.param(name, marks=pytest.mark.skipif(not chunk_kernels.available(ext, name),
                                                       reason=f"{name} does not run on this CPU (or no extension)"))
           for name in chunk_kernels.KERNELS]

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
@pytest.mark.parametrize("kernel", KERNELS)
def test_chunks_match_the_reference(kernel, ctx, q_len, heads):
    inputs = build([(ctx, q_len)], *heads, 64, 16, torch.bfloat16, seed=ctx + q_len)
    query = fused_qkv_view(inputs["query"], extra=2 * heads[1] * 64)
    table = inputs["block_tables"][0]
    got = chunk_kernels.chunk_attention(ext, kernel, query, inputs["k_cache"], inputs["v_cache"], table, ctx, 0.125)
    want = chunk_kernels.reference(query, inputs["k_cache"], inputs["v_cache"], table, ctx, 0.125)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got.float(), want, **TOL)


@pytest.mark.parametrize("window", [1, 5, 64, 100, 5000])
@pytest.mark.parametrize("ctx,q_len", [(300, 300), (500, 200), (77, 40)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kernel", KERNELS)
def test_sliding_windows_and_block_sizes(kernel, window, ctx, q_len, block_size):
    inputs = build([(ctx, q_len)], 9, 3, 64, block_size, torch.bfloat16, seed=window)
    table = inputs["block_tables"][0]
    args = (inputs["query"], inputs["k_cache"], inputs["v_cache"], table, ctx, 0.125, window)
    got = chunk_kernels.chunk_attention(ext, kernel, *args)
    torch.testing.assert_close(got.float(), chunk_kernels.reference(*args), **TOL)


@pytest.mark.parametrize("growth", [0.01, 0.05, -0.02])
@pytest.mark.parametrize("kernel", KERNELS)
def test_scores_that_keep_rising_or_falling_along_the_context(kernel, growth):
    """Keys whose scale grows (or shrinks) with their position, so that a row's largest score keeps
    moving block after block by far more than a lazily raised max allows (AMX: kLazyRescale, 2^8),
    and its sum and accumulators are rescaled many times; scores span ~+-100 at the extremes."""
    ctx = 700
    inputs = build([(ctx, ctx)], 9, 3, 64, 16, torch.bfloat16, seed=11)
    table = inputs["block_tables"][0]
    k = inputs["k_cache"].float()
    pos = torch.arange(ctx)
    slots = table[pos // 16].long() * 16 + pos % 16
    flat = k.view(-1, *k.shape[2:])
    flat[slots] *= torch.exp(growth * pos.float())[:, None, None].clamp(max=40)
    k_cache = flat.view_as(k).bfloat16()
    query = inputs["query"] * 4
    args = (query, k_cache, inputs["v_cache"], table, ctx, 0.125)
    got = chunk_kernels.chunk_attention(ext, kernel, *args)
    torch.testing.assert_close(got.float(), chunk_kernels.reference(*args), **TOL)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_backend_sends_long_bfloat16_chunks_here(kernel):
    from kernels.cpu.backend import make_backend

    inputs = build([(5, 1), (300, 64), (40, 3), (257, 257)], 9, 3, 64, 16, torch.bfloat16, seed=3)
    out = make_backend(ext, chunk=kernel).paged_attention(**inputs)
    sdpa = make_backend(ext, chunk=None).paged_attention(**inputs)
    for i, (start, ctx, q_len) in enumerate([(1, 300, 64), (68, 257, 257)]):
        rows = slice(start, start + q_len)
        table = inputs["block_tables"][[1, 3][i]]
        direct = chunk_kernels.chunk_attention(ext, kernel, inputs["query"][rows], inputs["k_cache"], inputs["v_cache"],
                                               table, ctx, 64**-0.5)
        assert torch.equal(out[rows], direct)
        assert not torch.equal(sdpa[rows], direct)  # the SDPA path is another computation
    # decode rows and short chunks stay on the C++ kernel, identical either way
    assert torch.equal(out[0], sdpa[0]) and torch.equal(out[65:68], sdpa[65:68])


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_bad_block_table_raises(kernel):
    inputs = build([(100, 50)], 9, 3, 64, 16, torch.bfloat16)
    table = inputs["block_tables"][0].clone()
    table[2] = inputs["k_cache"].shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        chunk_kernels.chunk_attention(ext, kernel, inputs["query"], inputs["k_cache"], inputs["v_cache"], table, 100, 0.125)
    with pytest.raises(RuntimeError, match="block table too short"):
        chunk_kernels.chunk_attention(ext, kernel, inputs["query"], inputs["k_cache"], inputs["v_cache"], table[:3], 100,
                                      0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        chunk_kernels.chunk_attention(ext, kernel, inputs["query"].float(), inputs["k_cache"], inputs["v_cache"], table,
                                      100, 0.125)


def test_the_best_kernel_here_is_the_default_and_the_environment_switch_picks_another(monkeypatch):
    from kernels.cpu.backend import CHUNK_KERNEL_ENV, chosen_chunk_kernel, make_backend

    best = chunk_kernels.best(ext)
    if best is None:
        pytest.skip("no chunk kernel runs on this CPU")
    assert chosen_chunk_kernel(ext) == best
    assert best == "amx" or not chunk_kernels.available(ext, "amx")  # AMX first wherever it runs
    inputs = build([(300, 64), (5, 1)], 9, 3, 64, 16, torch.bfloat16, seed=5)
    assert torch.equal(make_backend(ext).paged_attention(**inputs), make_backend(ext, chunk=best).paged_attention(**inputs))
    monkeypatch.setenv(CHUNK_KERNEL_ENV, "sdpa")
    assert chosen_chunk_kernel(ext) is None
    assert torch.equal(make_backend(ext).paged_attention(**inputs), make_backend(ext, chunk=None).paged_attention(**inputs))
    for name in chunk_kernels.KERNELS:
        monkeypatch.setenv(CHUNK_KERNEL_ENV, name)
        if chunk_kernels.available(ext, name):
            assert chosen_chunk_kernel(ext) == name
        else:
            with pytest.raises(ValueError, match="choose auto, sdpa or one that runs here"):
                make_backend(ext)
    monkeypatch.setenv(CHUNK_KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match=CHUNK_KERNEL_ENV):
        make_backend(ext)
