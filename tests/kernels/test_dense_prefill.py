"""The CPU backend's SDPA path for long chunks (kernels.cpu.dense_attention) against the torch reference.

Ragged steps mixing decode rows, short chunks (the C++ kernel) and long chunks (SDPA) in one call:
chunks starting at position 0 and after earlier context (bottom-right causal alignment), block tables
scattered in a noisy pool with partial last blocks, GQA and MHA, sliding windows, float32 and bfloat16,
and a cache in another dtype. Outputs are compared with the float32 reference over the same rounded
inputs, with the tolerances of the C++ kernel's tests; the long chunks are checked to have taken the
SDPA path, and `row_invariant_paged_attention` to have stayed on the C++ kernel.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cpu.build import load
from kernels.cpu.dense_attention import chunk_attention
from tests.kernels.paged_batch import build, param_id

ext = load()
pytestmark = pytest.mark.skipif(ext is None, reason="the C++ CPU extension failed to build (see the warning)")

if ext is not None:
    from kernels.cpu.backend import make_backend

MIN_ROWS = 24
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1e-2, 2**-7)}  # as tests/kernels/test_cpu_kernels.py


def ragged(block_size: int) -> list[tuple[int, int]]:
    """(context_len, q_len) of one step: long chunks around short ones and decode rows."""
    return [
        (97, 97),  # a whole prompt, several blocks, partial last one
        (1, 1),  # decode, context of one token
        (3 * block_size + 5, 1),  # decode, partial last block
        (150, 40),  # chunked prefill over 110 tokens of earlier context
        (30, 7),  # a short chunk: the C++ kernel
        (MIN_ROWS, MIN_ROWS),  # exactly the threshold
        (4 * block_size, MIN_ROWS - 1),  # just under it, over earlier context
        (200, 199),  # a prefix-cache hit of one token
    ]


def expected(inputs, window):
    return reference.paged_attention(
        **{k: (v.float() if k in ("query", "k_cache", "v_cache") else v) for k, v in inputs.items()},
        sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("window", [None, 5, 64])
def test_a_ragged_step_matches_the_reference(dtype, block_size, heads, window):
    num_heads, num_kv_heads = heads
    inputs = build(ragged(block_size), num_heads, num_kv_heads, 64, block_size, dtype, pad_columns=2)
    want = expected(inputs, window)
    for backend in (make_backend(ext, dense_min_rows=MIN_ROWS, dense_min_work=0, chunk=None),
                    make_backend(ext, dense_min_rows=MIN_ROWS, dense_min_work=0), make_backend(ext)):
        got = backend.paged_attention(**inputs, sliding_window=window)
        assert got.dtype == dtype
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("seq", [(300, 300), (300, 64), (257, 200)], ids=["from-0", "mid-context", "ragged-end"])
@pytest.mark.parametrize("window", [None, 50])
def test_the_long_chunks_take_the_sdpa_path(dtype, seq, window):
    """chunk_attention alone against the reference; and its result is what the backend returns for the
    chunk bit for bit (so the backend did route it there), while the C++-only op differs from it."""
    inputs = build([(5, 1), seq, (40, 3)], 9, 3, 64, 16, dtype, seed=3)
    ctx, q_len = seq
    rows = slice(1, 1 + q_len)
    direct = chunk_attention(inputs["query"][rows], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"][1],
                             ctx, 64**-0.5, window or 0)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(direct.float(), expected(inputs, window)[rows], atol=atol, rtol=rtol)
    backend = make_backend(ext, dense_min_rows=MIN_ROWS, dense_min_work=0, chunk=None)
    assert torch.equal(backend.paged_attention(**inputs, sliding_window=window)[rows], direct)
    kernel_only = backend.row_invariant_paged_attention(**inputs, sliding_window=window)
    torch.testing.assert_close(kernel_only.float(), expected(inputs, window), atol=atol, rtol=rtol)
    assert not torch.equal(kernel_only[rows], direct)


def test_a_strided_query_and_a_cache_in_another_dtype():
    """q as a view into the fused QKV output, the pool in bfloat16 under float32 activations."""
    inputs = build([(70, 70), (33, 1), (90, 30)], 9, 3, 64, 16, torch.bfloat16)
    n = inputs["query"].shape[0]
    qkv = torch.randn(n, 15 * 64)
    qkv[:, : 9 * 64] = inputs["query"].float().reshape(n, -1)
    inputs["query"] = qkv[:, : 9 * 64].view(n, 9, 64)
    got = make_backend(ext, dense_min_rows=MIN_ROWS, dense_min_work=0).paged_attention(**inputs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected(inputs, None), atol=2e-5, rtol=2e-5)


def test_the_default_thresholds_pick_the_path_by_rows_and_work():
    """Under DENSE_MIN_ROWS rows, or q_len x context under the build's minimum work (CHUNK_MIN_WORK of the
    chunk kernel that runs here, else DENSE_MIN_WORK_TWO_PASS where the kernel takes its AVX-512 two-pass
    path, else DENSE_MIN_WORK): the C++ kernel's bits; else the chunk path's (the chunk kernel's, or SDPA's)."""
    from kernels.cpu import chunk_kernels
    from kernels.cpu.backend import (
        CHUNK_MIN_WORK,
        DENSE_MIN_ROWS,
        DENSE_MIN_WORK,
        DENSE_MIN_WORK_TWO_PASS,
    )

    best = chunk_kernels.best(ext)
    min_work = (CHUNK_MIN_WORK[best] if best else DENSE_MIN_WORK_TWO_PASS if ext.two_pass_attention()
                else DENSE_MIN_WORK)
    backend = make_backend(ext)
    cases = {  # (context, q_len): the chunk path?
        (4000, DENSE_MIN_ROWS): DENSE_MIN_ROWS * 4000 >= min_work,
        (4000, DENSE_MIN_ROWS - 1): False,
        (32, 32): 32 * 32 >= min_work,
        (64, 64): 64 * 64 >= min_work,
        (256, 256): 256 * 256 >= min_work,
        (300, 150): 300 * 150 >= min_work,
    }
    for (ctx, q_len), dense in cases.items():
        inputs = build([(ctx, q_len), (20, 1)], 9, 3, 64, 16, torch.bfloat16, seed=ctx + q_len)
        got = backend.paged_attention(**inputs)[:q_len]
        kernel = backend.row_invariant_paged_attention(**inputs)[:q_len]
        args = (inputs["query"][:q_len], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"][0], ctx,
                64**-0.5)
        direct = chunk_kernels.chunk_attention(ext, best, *args) if best else chunk_attention(*args, 0)
        assert torch.equal(got, direct if dense else kernel), (ctx, q_len)
        assert not torch.equal(direct, kernel), (ctx, q_len)
