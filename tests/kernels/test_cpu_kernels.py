"""The C++ CPU kernels (kernels/cpu) against the torch reference they replace.

Paged attention on scattered block tables with partial blocks, context 1 and block
boundaries, GQA ratios 1/3/4, block sizes 8/16/32, decode and chunked prefill mixed in
one step, sliding windows, float32 and bfloat16; and each fused op of a decoder layer.
Outputs are compared with the float32 reference over the same rounded inputs: float32
within float32 rounding, bfloat16 within one bfloat16 rounding of the output.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cpu.build import load
from tests.kernels.paged_batch import build, param_id

ext = load()
pytestmark = pytest.mark.skipif(ext is None, reason="the C++ CPU extension failed to build (see the warning)")

if ext is not None:
    from kernels.cpu.backend import make_backend

    cpu = make_backend(ext)

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1e-2, 2**-7)}


def mixed(block_size):
    return [
        (1, 1),  # context of one token
        (block_size, 1),  # decode on a block boundary
        (block_size + 1, 1),  # one token into a new block
        (3 * block_size + 5, 1),  # partial last block
        (2 * block_size, 2 * block_size),  # whole prompt ending on a boundary
        (50, 13),  # chunk over earlier context
        (40, 39),  # prefix-cache hit of one token
        (3 * block_size + 7, 3 * block_size + 7),  # long prompt, several query tiles
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 64/128 take the AVX-512 two-pass path, 80 the online one
def test_paged_attention_matches_reference(dtype, block_size, heads, window, head_dim):
    num_heads, num_kv_heads = heads
    inputs = build(mixed(block_size), num_heads, num_kv_heads, head_dim, block_size, dtype, pad_columns=2)
    expected = reference.paged_attention(
        **{k: (v.float() if k in ("query", "k_cache", "v_cache") else v) for k, v in inputs.items()},
        sliding_window=window)
    actual = cpu.paged_attention(**inputs, sliding_window=window)
    assert actual.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=rtol)


def test_paged_attention_reads_a_strided_query():
    """q as a view into the fused QKV output (rows wider than heads x head_dim)."""
    inputs = build([(33, 1), (20, 5)], 9, 3, 64, 16, torch.float32)
    n = inputs["query"].shape[0]
    qkv = torch.randn(n, 15 * 64)
    qkv[:, : 9 * 64] = inputs["query"].reshape(n, -1)
    inputs["query"] = qkv[:, : 9 * 64].view(n, 9, 64)
    expected = reference.paged_attention(**{**inputs, "query": inputs["query"].contiguous()})
    torch.testing.assert_close(cpu.paged_attention(**inputs), expected, atol=2e-5, rtol=2e-5)


def test_paged_attention_rejects_a_short_block_table():
    inputs = build([(40, 1)], 4, 4, 64, 16, torch.float32)
    inputs["block_tables"] = inputs["block_tables"][:, :2]
    with pytest.raises(RuntimeError, match="block table too short"):
        cpu.paged_attention(**inputs)


def call_op(inputs, op) -> torch.Tensor:
    """The C++ entry point itself (pybind, or the dispatcher op), no Python checks in front."""
    out = torch.empty(inputs["query"].shape, dtype=inputs["query"].dtype)
    op(out, inputs["query"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"],
       inputs["query_start_loc"], inputs["context_lens"], 0.125, 0)
    return out


OPS = {"pybind": lambda: ext.paged_attention, "dispatcher": lambda: torch.ops.pagedserve.paged_attention}


@pytest.mark.parametrize("op", OPS, ids=list(OPS))
@pytest.mark.parametrize("bad", [-1, "pool", 1 << 40], ids=["negative", "pool_size", "huge"])
@pytest.mark.parametrize("where", ["first", "last_used"])
def test_paged_attention_rejects_a_block_id_outside_the_pool(op, bad, where):
    inputs = build([(40, 1), (33, 33)], 4, 2, 64, 16, torch.float32)
    call_op(inputs, OPS[op]())  # the good batch runs
    num_blocks = inputs["k_cache"].shape[0]
    tables = inputs["block_tables"].clone()
    tables[1, 0 if where == "first" else 2] = num_blocks if bad == "pool" else bad
    with pytest.raises(RuntimeError, match=r"sequence 1: block id -?\d+ at index \d outside the KV pool of "
                                           rf"{num_blocks} blocks"):
        call_op({**inputs, "block_tables": tables}, OPS[op]())


@pytest.mark.parametrize("op", OPS, ids=list(OPS))
def test_paged_attention_rejects_a_context_past_its_table_or_query(op):
    inputs = build([(40, 1), (20, 5)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match=r"sequence 0: block table too short for its context \(49 tokens need "
                                           r"4 blocks, the table has 3\)"):
        call_op({**inputs, "context_lens": torch.tensor([49, 20])}, OPS[op]())
    with pytest.raises(RuntimeError, match="sequence 1: more new tokens than context"):
        call_op({**inputs, "context_lens": torch.tensor([40, -3])}, OPS[op]())
    with pytest.raises(RuntimeError, match="query_start_loc runs past the query's 6 tokens"):
        call_op({**inputs, "query_start_loc": torch.tensor([0, 1, 600])}, OPS[op]())
    with pytest.raises(RuntimeError, match="query_start_loc runs past"):
        call_op({**inputs, "query_start_loc": torch.tensor([-4, 1, 6])}, OPS[op]())
    with pytest.raises(RuntimeError, match="block_tables must be"):
        call_op({**inputs, "block_tables": inputs["block_tables"].flatten()}, OPS[op]())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_norms_and_silu_match_reference(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (0, 2**-7)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), atol=atol, rtol=rtol)
    want_x, want_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    got_x, got_res = cpu.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(got_x, want_x, atol=atol, rtol=rtol)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen).to(dtype) * 4
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), atol=atol, rtol=rtol)


def rope_both(dtype, kv_dtype, seed):
    """RoPE + cache write of the same 21 tokens (9 heads, 3 KV heads) by the reference and the
    kernel: (reference q, kernel q, [ref k, ref v, kernel k, kernel v] caches)."""
    heads, kv_heads, d, bs, n = 9, 3, 64, 16, 21
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (n,), generator=gen)
    slots = torch.randperm(10 * bs, generator=gen)[:n]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(512).float()[:, None] * inv_freq
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).float()
    caches = [torch.zeros(10, bs, kv_heads, d, dtype=kv_dtype) for _ in range(4)]
    want_q = reference.rope_and_cache(qkv.clone(), positions, cos_sin, caches[0], caches[1], slots, heads, kv_heads)
    got_q = cpu.rope_and_cache(qkv.clone(), positions, cos_sin, caches[2], caches[3], slots, heads, kv_heads)
    return want_q, got_q, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_rope_and_cache_matches_reference(dtype):
    want_q, got_q, caches = rope_both(dtype, dtype, seed=0)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (0, 0)
    torch.testing.assert_close(got_q, want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(caches[2], caches[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0)


def test_rope_and_cache_rejects_a_slot_outside_the_pool():
    qkv = torch.randn(1, 3 * 64)
    caches = [torch.zeros(2, 16, 1, 64) for _ in range(2)]
    cos_sin = torch.zeros(8, 64)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        cpu.rope_and_cache(qkv, torch.tensor([0]), cos_sin, *caches, torch.tensor([32]), 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_int8_group_linear_matches_reference(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    qweight = torch.randint(-127, 128, (200, 96), generator=g, dtype=torch.int8)
    scales = torch.rand(200, 3, generator=g) * 0.01
    x = torch.randn(rows, 96, generator=g).to(dtype)
    out = torch.empty(rows, 200, dtype=dtype)
    ext.int8_group_linear(out, x, qweight, scales)
    ref = reference.int8_group_linear(x, qweight, scales)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))
    # the reference itself is plain float32 math on the dequantized weight
    w = qweight.float() * scales.repeat_interleave(32, dim=1)
    assert torch.allclose(ref.float(), (x.float() @ w.t()).to(dtype).float())


def test_int8_group_linear_rejects_bad_shapes():
    out = torch.empty(1, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.int8_group_linear(out, torch.randn(1, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8, 1))
    with pytest.raises(RuntimeError, match="scales"):
        ext.int8_group_linear(out, torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 3))


def q4_weight(n: int, k: int, seed: int):
    """Random Q4_1 blocks: codes 0..15 [n, k], scale and min [n, k / 32]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    return codes, torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4, -torch.rand(n, k // 32, generator=g) * 0.1


def test_q4_pack_round_trips():
    codes, scale, low = q4_weight(48, 96, 0)
    packed, d, m = reference.q4_pack(codes, scale, low)
    assert packed.dtype == torch.uint8 and packed.numel() == 48 * 96 // 2 and d.shape == (3, 3, 16)
    assert torch.equal(reference.q4_unpack(packed, 48, 96), codes.to(torch.uint8))
    assert torch.equal(d.transpose(1, 2).reshape(48, 3), scale) and torch.equal(m.transpose(1, 2).reshape(48, 3), low)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 31])
@pytest.mark.parametrize("shape", [(16, 32), (48, 576), (64, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_q4_linear_matches_reference(dtype, rows, shape):
    n, k = shape
    codes, scale, low = q4_weight(n, k, rows)
    packed, d, m = reference.q4_pack(codes, scale, low)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    if k > 32:
        x[0, :32] = 0  # a group of zeros quantizes to scale 0
    out = cpu.q4_linear(x, packed, d, m)
    ref = reference.q4_linear(x, packed, d, m)
    assert out.dtype == dtype and out.shape == (rows, n)
    # the reference sums in float64: the kernel's float32 sums of k / 32 group terms differ by rounding
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))
    # and the reference is x @ w.T up to quantizing x to int8 per group of 32 (about 0.5% of its norm)
    w = codes.float() * scale.repeat_interleave(32, dim=1) + low.repeat_interleave(32, dim=1)
    dense = x.float() @ w.t()
    assert float((ref.float() - dense).norm() / dense.norm()) < 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=param_id)
def test_q4_linear_writes_x_dtype_as_its_float32_result_rounded(dtype):
    """A bfloat16/float16 out gets the float32 sums rounded once (as .to() would round them), and
    more rows than one chunk of the kernel's row blocking (128 KB of int8 rows: 85 at K=1536)
    give each row what it gets alone."""
    n, k, rows = 64, 1536, 200
    packed, d, m = reference.q4_pack(*q4_weight(n, k, 3))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    full = torch.empty(rows, n)
    ext.q4_linear(full, x, packed, d, m)
    typed = torch.empty(rows, n, dtype=dtype)
    ext.q4_linear(typed, x, packed, d, m)
    assert torch.equal(typed, full.to(dtype))
    for r in (0, 95, 199):
        one = torch.empty(1, n)
        ext.q4_linear(one, x[r:r + 1].contiguous(), packed, d, m)
        assert torch.equal(one[0], full[r])
    with pytest.raises(RuntimeError, match="out must be"):
        ext.q4_linear(torch.empty(rows, n, dtype=torch.float64), x, packed, d, m)


TILES_ROWS = ext.q4_linear_tiles_rows() if ext is not None else 0
needs_tiles = pytest.mark.skipif(not TILES_ROWS, reason="no AMX tiles here (q4_linear_tiles_rows() is 0)")


@needs_tiles
@pytest.mark.parametrize("scales", [torch.float16, torch.float32], ids=param_id)
@pytest.mark.parametrize("rows", [1, 16, 17, 28, 64, 65, 300])
@pytest.mark.parametrize("shape", [(16, 32), (48, 576), (64, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_q4_linear_tiles_matches_reference(scales, rows, shape):
    """bfloat16 rows times the weights dequantized to bfloat16, summed in float32: rows past a whole
    tile (17, 65), past the 4 tiles of a pass (65) and past a 256-row chunk (300) included."""
    n, k = shape
    codes, scale, low = q4_weight(n, k, rows)
    packed, d, m = reference.q4_pack(codes, scale, low)
    d, m = d.to(scales), m.to(scales)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    want = reference.q4_linear_tiles(x.double(), packed, d, m).double()
    full = torch.empty(rows, n)
    ext.q4_linear_tiles(full, x, packed, d, m)
    # float32 sums of k products; float32 scales' d * c rounds before m is added (an fma in the
    # kernel), which may move a weight to the neighbouring bfloat16
    tol = 1e-5 if scales == torch.float16 else 2e-3
    torch.testing.assert_close(full.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    typed = torch.empty(rows, n, dtype=torch.bfloat16)
    ext.q4_linear_tiles(typed, x, packed, d, m)
    assert torch.equal(typed, full.bfloat16())


@needs_tiles
def test_q4_linear_tiles_gives_a_row_the_same_bits_at_any_row_count():
    """Each row's sums run over the groups in one order whatever shares the call (padding, the
    4-tile passes and 256-row chunks only group rows)."""
    packed, d, m = reference.q4_pack(*q4_weight(64, 576, 4))
    d, m = d.half(), m.half()
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    full = torch.empty(300, 64)
    ext.q4_linear_tiles(full, x, packed, d, m)
    for r0, r1 in ((0, 1), (5, 22), (250, 300), (299, 300)):
        part = torch.empty(r1 - r0, 64)
        ext.q4_linear_tiles(part, x[r0:r1].contiguous(), packed, d, m)
        assert torch.equal(part, full[r0:r1]), (r0, r1)


def test_q4_linear_tiles_takes_bfloat16_rows_only():
    packed, d, m = reference.q4_pack(*q4_weight(16, 64, 0))
    with pytest.raises(RuntimeError, match="bfloat16 rows and AMX"):
        ext.q4_linear_tiles(torch.empty(32, 16), torch.randn(32, 64), packed, d, m)


@pytest.mark.parametrize("rows", [1, 5, 8, 13])
def test_q8_linear_matches_reference(rows):
    """8-bit codes 0..255 (the head's Q8_0 + 128): products up to 255 * 127 that AVX2's maddubs
    pair sums could not hold, so its path splits the codes into nibbles."""
    n, k = 48, 576
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 256, (n, k), generator=g)
    codes[:, :32] = 255
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4
    packed, d, m = reference.q8_pack(codes, scale, -128 * scale)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    x[:, :32] = x[:, :32].abs() + 1  # every product of the first group at its largest
    got = torch.empty(rows, n)
    ext.q8_linear(got, x, packed, d, m)
    want = reference.q8_linear(x, packed, d, m, torch.empty(rows, n))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    typed = torch.empty(rows, n, dtype=torch.bfloat16)
    ext.q8_linear(typed, x.bfloat16(), packed, d, m)
    full = torch.empty(rows, n)
    ext.q8_linear(full, x.bfloat16(), packed, d, m)
    assert torch.equal(typed, full.to(torch.bfloat16))


@needs_tiles
@pytest.mark.parametrize("scales", [torch.float16, torch.float32], ids=param_id)
@pytest.mark.parametrize("offset", ["q8_0", "explicit"])
@pytest.mark.parametrize("rows", [1, 17, 64, 65, 300])
def test_q8_linear_tiles_matches_reference(scales, offset, rows):
    """A Q8_0 head's codes (c + 128) dequantized to bfloat16 on the tiles, d * c - 128 d exact in
    float32 (the dense head's weights), summed in float32: an empty m (Q8_0's -128 d) and an
    explicit one alike; rows past a tile, past a 4-tile pass and past a 256-row chunk included."""
    n, k = 64, 576
    g = torch.Generator().manual_seed(rows)
    signed = torch.randint(-127, 128, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half().float()
    packed, d, m = reference.q8_pack(signed + 128, scale, -128 * scale)
    d, m = d.to(scales), m.to(scales)
    if offset == "q8_0":
        m = d.new_empty(0)
    x = torch.randn(rows, k, generator=g).bfloat16()
    dense = (scale.repeat_interleave(32, 1) * signed).bfloat16()
    assert torch.equal(reference.q8_dequantize(packed, d, m), dense)
    want = reference.q8_linear_tiles(x, packed, d, m, torch.empty(rows, n)).double()
    got = torch.empty(rows, n)
    ext.q8_linear_tiles(got, x, packed, d, m)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    typed = torch.empty(rows, n, dtype=torch.bfloat16)
    ext.q8_linear_tiles(typed, x, packed, d, m)
    assert torch.equal(typed, got.bfloat16())
    for r0, r1 in ((0, 1), (rows - 1, rows)):  # a row's bits whatever shares its call
        part = torch.empty(r1 - r0, n)
        ext.q8_linear_tiles(part, x[r0:r1].contiguous(), packed, d, m)
        assert torch.equal(part, got[r0:r1])


def test_pack_tiles_round_trips_and_rejects_partial_tiles():
    w = torch.randn(48, 96).bfloat16()
    packed = reference.pack_tiles(w)
    assert packed.shape == (3, 3, 16, 16) and packed.dtype == torch.int32
    assert torch.equal(reference.unpack_tiles(packed), w)
    # B tile (block 1, group 2), pair row 5, lane 7: inputs 64 + 10 and 64 + 11 of output 16 + 7
    pair = packed[1, 2, 5, 7:8].view(torch.bfloat16)
    assert torch.equal(pair, w[23, 74:76])
    for bad in (torch.randn(40, 96).bfloat16(), torch.randn(48, 80).bfloat16(), torch.randn(48, 96)):
        with pytest.raises(ValueError, match="pack_tiles"):
            reference.pack_tiles(bad)


@needs_tiles
@pytest.mark.parametrize(("n", "k"), [(48, 96), (64, 576), (96, 1536)])
@pytest.mark.parametrize("rows", [1, 17, 32, 65, 300, 1100])
def test_bf16_linear_tiles_matches_reference(n, k, rows):
    """Dense bfloat16 weights in the tiles' layout: float32 sums within float32 rounding of the float64
    reference, the bfloat16 output their rounding; an odd block count (48 outputs: 3 blocks, one thread's
    last block alone), rows past a tile, a pair of tiles and a row chunk (1,100 rows of K=1536)."""
    g = torch.Generator().manual_seed(rows * n)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = reference.pack_tiles(w)
    want = reference.bf16_linear_tiles(x, packed, torch.empty(rows, n)).double()
    got = torch.empty(rows, n)
    ext.bf16_linear_tiles(got, x, packed)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    typed = torch.empty(rows, n, dtype=torch.bfloat16)
    ext.bf16_linear_tiles(typed, x, packed)
    assert torch.equal(typed, got.bfloat16())
    for r0, r1 in ((0, 1), (rows - 1, rows)):  # a row's bits whatever shares its call
        part = torch.empty(r1 - r0, n)
        ext.bf16_linear_tiles(part, x[r0:r1].contiguous(), packed)
        assert torch.equal(part, got[r0:r1])
    assert torch.equal(cpu.bf16_linear_tiles(x, packed), typed)


@needs_tiles
def test_bf16_linear_tiles_rejects_bad_arguments():
    w = torch.randn(32, 64).bfloat16()
    packed = reference.pack_tiles(w)
    with pytest.raises(RuntimeError, match="columns"):
        ext.bf16_linear_tiles(torch.empty(2, 32), torch.randn(2, 96).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="x"):
        ext.bf16_linear_tiles(torch.empty(2, 32), torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="out"):
        ext.bf16_linear_tiles(torch.empty(2, 16), torch.randn(2, 64).bfloat16(), packed)
    ext.bf16_linear_tiles(torch.empty(0, 32), torch.randn(0, 64).bfloat16(), packed)


@needs_tiles
@pytest.mark.parametrize("rows", [1, 17, 32, 48, 65, 214, 300])
@pytest.mark.parametrize(("inter", "k"), [(32, 64), (48, 96), (1536, 576)], ids=lambda v: str(v))
def test_gate_up_silu_tiles_are_the_matmul_then_silu_and_mul(rows, inter, k):
    """Both fused kernels give the bits of their tile matmul followed by silu_and_mul (gate block j paired
    with up block j, combined as stored): rows past a tile, one 32-row pass and a 256-row chunk, an odd
    block count in each half (48), SmolLM2's shape; and their torch references within bfloat16 rounding."""
    g = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed, d, m = reference.q4_pack(*q4_weight(2 * inter, k, rows))
    d, m = d.half(), m.half()
    two_ops = torch.empty(rows, 2 * inter, dtype=torch.bfloat16)
    ext.q4_linear_tiles(two_ops, x, packed, d, m)
    want = torch.empty(rows, inter, dtype=torch.bfloat16)
    ext.silu_and_mul(want, two_ops)
    got = torch.empty(rows, inter, dtype=torch.bfloat16)
    ext.q4_gate_up_silu_tiles(got, x, packed, d, m)
    assert torch.equal(got, want)
    ref = reference.q4_gate_up_silu_tiles(x, packed, d, m).float()
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    assert torch.equal(cpu.q4_gate_up_silu_tiles(x, packed, d, m), got)

    tiles = reference.pack_tiles((torch.randn(2 * inter, k, generator=g) * 0.05).bfloat16())
    two_ops = torch.empty(rows, 2 * inter, dtype=torch.bfloat16)
    ext.bf16_linear_tiles(two_ops, x, tiles)
    ext.silu_and_mul(want, two_ops)
    ext.bf16_gate_up_silu_tiles(got, x, tiles)
    assert torch.equal(got, want)
    ref = reference.bf16_gate_up_silu_tiles(x, tiles).float()
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    assert torch.equal(cpu.bf16_gate_up_silu_tiles(x, tiles), got)


@needs_tiles
def test_gate_up_silu_tiles_reject_bad_arguments():
    """Halves that split a 16-output block, an output of the wrong width or dtype: errors, not reads past it."""
    x = torch.randn(4, 64).bfloat16()
    packed, d, m = reference.q4_pack(*q4_weight(48, 64, 0))  # 3 blocks: no gate/up halves
    with pytest.raises(RuntimeError, match="even"):
        ext.q4_gate_up_silu_tiles(torch.empty(4, 24, dtype=torch.bfloat16), x, packed, d, m)
    with pytest.raises(RuntimeError, match="even"):
        ext.bf16_gate_up_silu_tiles(torch.empty(4, 24, dtype=torch.bfloat16), x,
                                    reference.pack_tiles(torch.randn(48, 64).bfloat16()))
    packed, d, m = reference.q4_pack(*q4_weight(64, 64, 0))
    tiles = reference.pack_tiles(torch.randn(64, 64).bfloat16())
    for out in (torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(4, 32)):
        with pytest.raises(RuntimeError, match="out must be"):
            ext.q4_gate_up_silu_tiles(out, x, packed, d, m)
        with pytest.raises(RuntimeError, match="out must be"):
            ext.bf16_gate_up_silu_tiles(out, x, tiles)


@pytest.mark.parametrize("rows", [1, 8, 13, 64])
def test_q8_linear_q8_0_offset_in_integer_sums(rows):
    """An empty m says the codes are Q8_0's c + 128 (m = -128 d): the kernel adds -128 * the sum of
    each group's input codes to its integer dot product instead of a float min term. Both forms
    quantize the inputs alike, so they differ by float32 rounding alone (the explicit one subtracts
    two large terms); against the float64 reference, as test_q8_linear_kernel_matches_its_reference
    allows (an input within an ulp of a half may round to the other code there)."""
    n, k = 64, 1536
    g = torch.Generator().manual_seed(100 + rows)
    signed = torch.randint(-127, 128, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half().float()
    packed, d, m = reference.q8_pack(signed + 128, scale, -128 * scale)
    x = torch.randn(rows, k, generator=g).bfloat16()
    want = reference.q8_linear(x, packed, d, m, torch.empty(rows, n))
    assert torch.equal(want, reference.q8_linear(x, packed, d, d.new_empty(0), torch.empty(rows, n)))
    explicit, offset = torch.empty(rows, n), torch.empty(rows, n)
    ext.q8_linear(explicit, x, packed, d, m)
    ext.q8_linear(offset, x, packed, d, d.new_empty(0))
    top = float(want.abs().max())
    assert (offset - explicit).abs().max() <= 1e-5 * top
    assert torch.allclose(offset, want, rtol=1e-5, atol=2e-3 * top)
    half = torch.empty(rows, n)
    ext.q8_linear(half, x, packed, d.half(), d.half().new_empty(0))
    assert torch.equal(half, offset)  # d is float16-exact here
    with pytest.raises(RuntimeError, match="Q8_0"):
        ext.q8_linear(offset, x, packed, d, d.half().new_empty(0))  # m's dtype must still be d's


def test_q4_linear_rejects_bad_shapes():
    packed, d, m = reference.q4_pack(*q4_weight(16, 64, 0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.q4_linear(torch.empty(1, 16), torch.randn(1, 40), packed, d, m)
    with pytest.raises(RuntimeError, match="packed"):
        ext.q4_linear(torch.empty(1, 16), torch.randn(1, 64), packed[:-1], d, m)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.float16)], ids=lambda d: f"{param_id(d[0])}-{param_id(d[1])}")
def test_paged_attention_reads_a_cache_in_another_dtype(dtypes):
    """--kv-cache-dtype: the query (and output) in one dtype, the pool in another."""
    dtype, kv_dtype = dtypes
    inputs = build(mixed(16), 9, 3, 64, 16, kv_dtype, pad_columns=1)
    inputs["query"] = inputs["query"].to(dtype)
    expected = reference.paged_attention(
        **{k: (v.float() if k in ("query", "k_cache", "v_cache") else v) for k, v in inputs.items()})
    torch.testing.assert_close(reference.paged_attention(**inputs).float(), expected, atol=TOL[dtype][0],
                               rtol=TOL[dtype][1])
    actual = cpu.paged_attention(**inputs)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=lambda d: f"{param_id(d[0])}-{param_id(d[1])}")
def test_rope_and_cache_writes_a_cache_in_another_dtype(dtypes):
    dtype, kv_dtype = dtypes
    want_q, got_q, caches = rope_both(dtype, kv_dtype, seed=1)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (0, 0)
    torch.testing.assert_close(got_q, want_q, atol=atol, rtol=rtol)
    # k is rotated in the compute dtype, then rounded once to the cache's: a float32 rotation a
    # rounding apart may round to a neighbouring bfloat16
    kv_atol, kv_rtol = (atol, rtol) if kv_dtype == torch.float32 else (1e-6, 2**-7)
    torch.testing.assert_close(caches[2], caches[0], atol=kv_atol, rtol=kv_rtol)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 49152])
def test_argmax_rows_is_numpys_argmax(vocab):
    """The first index of each row's maximum (ties, -inf rows, a maximum in the tail past the last
    16 lanes), and of the first NaN in a row that has one, as numpy's argmax."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (12, vocab), generator=g).float()  # many ties
    x[1] = float("-inf")
    x[2, -1] = 100.0
    x[3, vocab // 2] = float("nan")
    x[4, -1] = float("nan")
    x[5] = 7.0
    x[6, vocab // 3] = float("inf")
    out = torch.empty(12, dtype=torch.long)
    ext.argmax_rows(out, x)
    assert out.tolist() == x.numpy().argmax(axis=-1).tolist()
    with pytest.raises(RuntimeError, match="float32"):
        ext.argmax_rows(out, x.bfloat16())
