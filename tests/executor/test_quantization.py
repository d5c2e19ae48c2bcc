"""Weight-only int4 (services.executor.quantization) against plain float32 math.

- Quantizing a tensor already on a Q4_1 grid gives back its values (up to the
  bfloat16 rounding of scale and zero); `auto` quantizes only such checkpoints.
- The int4 matmul equals x @ dequantized(w).T within bfloat16 rounding.
- A linear uses its int4 copy only for calls of at most `max_rows` rows.
- A head already on a Q8_0 grid (SmolLM2's tied embedding) gets an int8 copy with its
  own values, used for steps of at most `max_rows` sampled rows.
- Loading with `quantization="auto"` quantizes a Q4_1-valued checkpoint and leaves
  an ordinary one alone.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cpu.build import load as load_cpu_kernels
from services.executor import quantization as q
from services.executor.loader import load_model
from services.executor.models.llama import Linear

pytestmark = pytest.mark.skipif(not q.supported("cpu"), reason="this torch has no CPU int4 kernel")


def q4_1_values(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A float32 tensor whose groups of 32 hold GGUF Q4_1 values: d * q + m, q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    groups = (out_features, in_features // 32, 1)
    d = (torch.rand(groups, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(groups, generator=g) * 0.2).half().float()
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 maps each group's min to 0 and its max to 15
    return (codes * d + m).view(out_features, in_features)


def test_q4_1_values_are_on_the_grid_and_round_trip():
    w = q4_1_values(64, 128)
    assert q.on_4bit_grid(w)
    assert not q.on_4bit_grid(torch.randn(64, 128))
    assert not q.on_4bit_grid(w.bfloat16().float() + 1e-3 * torch.randn(64, 128))
    codes, scale, low = q.q4_1_codes(w)
    assert torch.equal((codes * scale + low).view(64, 128), w)  # the file's own blocks, bit for bit
    back = q.dequantize(q.quantize_int4(w), codes)
    # only scale and zero are rounded to bfloat16 (half an ulp: 2**-8 relative): within that of each term
    bound = 2**-8 * (8 * scale + (low + 8 * scale).abs()) + 1e-7
    assert bool(((back - w).abs().view(64, 4, 32) <= bound).all())


@pytest.mark.parametrize("rows", [1, 3, 16, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul_matches_the_dequantized_weight(rows, dtype):
    w = q4_1_values(96, 256, seed=rows)
    int4 = q.quantize_int4(w)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.bfloat16().float() @ q.dequantize(int4, q.q4_1_codes(w)[0]).t()
    out = int4.matmul(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


def test_a_linear_uses_int4_only_up_to_max_rows():
    lin = Linear(128, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(q4_1_values(64, 128))
        lin.bias.copy_(torch.randn(64))
    lin.int4 = q.quantize_int4(lin.weight.data)
    lin.int4.max_rows = 4
    # a different int4 weight makes the path taken visible in the output
    lin.int4 = q.quantize_int4(q4_1_values(64, 128, seed=7))
    lin.int4.max_rows = 4
    x = torch.randn(8, 128)
    with torch.no_grad():
        dense = torch.nn.functional.linear(x, lin.weight, lin.bias)
        small, large = lin(x[:4]), lin(x)
    assert torch.equal(large, dense)
    assert torch.allclose(small, lin.int4.matmul(x[:4]) + lin.bias)
    assert not torch.allclose(small, dense[:4], atol=1e-2)


def test_resolve_mode():
    grid, off = [q4_1_values(64, 128)], [torch.randn(64, 128)]
    assert q.resolve_mode("auto", grid, "cpu")[0]
    chosen, why = q.resolve_mode("auto", off, "cpu")
    assert not chosen and "not 4-bit" in why
    assert q.resolve_mode("int4", off, "cpu")[0]
    assert not q.resolve_mode("none", grid, "cpu")[0]
    assert not q.resolve_mode("auto", grid, "meta")[0]
    with pytest.raises(ValueError, match="divisible"):
        q.resolve_mode("int4", [torch.randn(64, 100)], "cpu")
    with pytest.raises(ValueError, match="unknown quantization"):
        q.resolve_mode("int8", grid, "cpu")


def test_calibrate_returns_a_measured_row_count():
    layers = [(w, q.quantize_int4(w)) for w in (q4_1_values(256, 256, s) for s in range(4))]
    rows = q.calibrate(layers, torch.float32, rows=(1, 2, 4), reps=1)
    assert rows in (0, 1, 2, 4)


def q8_0_values(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A float32 tensor whose groups of 32 hold GGUF Q8_0 values: d * q, q in -127..127, |q| = 127 somewhere."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(out_features, in_features // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    codes = torch.randint(-127, 128, (out_features, in_features // 32, 32), generator=g).float()
    codes[..., 0] = 127
    return (codes * d).view(out_features, in_features)


def test_q8_0_values_round_trip_exactly():
    w = q8_0_values(64, 128)
    assert q.on_8bit_grid(w)
    assert not q.on_8bit_grid(q4_1_values(64, 128))
    assert not q.on_8bit_grid(torch.randn(64, 128))
    int8 = q.quantize_int8(w, reference.int8_group_linear)
    assert int8.qweight.dtype == torch.int8 and int8.scales.shape == (64, 4)
    back = int8.qweight.float() * int8.scales.repeat_interleave(32, dim=1)
    assert torch.equal(back, w)  # float32 scales: the file's own values, bit for bit
    x = torch.randn(3, 128)
    assert torch.allclose(int8.matmul(x), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_q8_0_as_8bit_codes_is_the_same_weight():
    w = q8_0_values(64, 128)
    q8 = q.quantize_q8(w, reference.q8_linear)
    codes = reference.q8_unpack(q8.packed, 64, 128).float()
    assert int(codes.min()) >= 1 and int(codes.max()) <= 255  # c + 128 for c in -127..127
    d = q8.d.transpose(1, 2).reshape(64, 4).repeat_interleave(32, dim=1)
    assert q8.m.numel() == 0  # Q8_0's min is -128 d: q8_linear adds it in its integer sums
    assert torch.equal(d * codes - 128 * d, w)  # the codes hold the file's values exactly
    assert q8.d.dtype == q8.m.dtype == torch.float16  # the file's scales fit float16
    assert q8.in_features == 128 and q8.nbytes == 64 * 128 + 64 * 4 * 2
    x = torch.randn(5, 128).bfloat16()
    ref = x.float() @ w.t()
    y = q8.matmul(x)
    assert y.dtype == torch.float32  # logits, rounded once
    # the input rows are quantized to int8 per group of 32, as for Q4 weights
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("rows", [1, 7, 8, 37])
def test_q8_linear_kernel_matches_its_reference(rows):
    ext = load_cpu_kernels()
    if ext is None:
        pytest.skip("the C++ CPU kernels did not build")
    w = q8_0_values(64, 1536)
    q8 = q.quantize_q8(w, reference.q8_linear)
    x = torch.randn(rows, 1536).bfloat16()
    want = reference.q8_linear(x, q8.packed, q8.d, q8.m, torch.empty(rows, 64))
    got = torch.empty(rows, 64)
    ext.q8_linear(got, x, q8.packed, q8.d, q8.m)
    # the reference sums in float64, and torch's 127 / amax can differ from the kernel's in the last
    # bit, so that an input x * 127 / amax within an ulp of a half rounds to the other code: one such
    # input moves an output by up to 255 * scale * dx (~4e-4 of the largest here)
    assert torch.allclose(got, want, rtol=1e-5, atol=2e-3 * float(want.abs().max()))
    typed = torch.empty(rows, 64, dtype=torch.bfloat16)
    ext.q8_linear(typed, x, q8.packed, q8.d, q8.m)
    assert torch.equal(typed, got.to(torch.bfloat16))


def test_a_q4_copy_runs_on_tiles_for_large_bfloat16_calls():
    """From the backend's q4_tiles_min_rows rows on, bfloat16 calls take q4_linear_tiles (the dense
    bfloat16 weights' products); fewer rows, or float32 ones, the integer q4_linear."""
    from kernels.cpu.backend import make_backend

    ext = load_cpu_kernels()
    if ext is None or not ext.q4_linear_tiles_rows():
        pytest.skip("no AMX tiles here")
    backend = make_backend(ext)
    w = q4_1_values(64, 576)
    copy = q.quantize_q4(w, backend.q4_linear, backend.q4_linear_tiles, backend.q4_tiles_min_rows)
    args = (copy.packed, copy.d, copy.m)
    x = torch.randn(backend.q4_tiles_min_rows, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(copy.matmul(x), backend.q4_linear_tiles(x, *args))
    assert torch.equal(copy.matmul(x[:-1]), backend.q4_linear(x[:-1], *args))
    assert torch.equal(copy.matmul(x.float()), backend.q4_linear(x.float(), *args))
    dense = (x.double() @ w.bfloat16().double().t()).float()
    assert torch.allclose(copy.matmul(x).float(), dense, rtol=2**-8, atol=1e-5 * float(dense.abs().max()))
    assert q.quantize_q4(w, backend.q4_linear).tiles_from == q.ALL_ROWS


def test_a_q8_head_runs_on_tiles_for_large_bfloat16_calls():
    """A Q8_0 head's copy takes q8_linear_tiles from the backend's q4_tiles_min_rows sampled rows on
    (bfloat16), the integer q8_linear below; both into float32 logits."""
    from kernels.cpu.backend import make_backend

    ext = load_cpu_kernels()
    if ext is None or not ext.q4_linear_tiles_rows():
        pytest.skip("no AMX tiles here")
    backend = make_backend(ext)
    g = torch.Generator().manual_seed(4)
    w = q8_0_values(64, 576, seed=4)
    copy = q.quantize_q8(w, backend.q8_linear, backend.q8_linear_tiles, backend.q4_tiles_min_rows)
    args = (copy.packed, copy.d, copy.m)
    x = torch.randn(backend.q4_tiles_min_rows, 576, generator=g).bfloat16()
    rows = x.shape[0]
    assert torch.equal(copy.matmul(x), backend.q8_linear_tiles(x, *args, out=torch.empty(rows, 64)))
    assert torch.equal(copy.matmul(x[:-1]), backend.q8_linear(x[:-1], *args, out=torch.empty(rows - 1, 64)))
    assert copy.matmul(x).dtype == torch.float32
    dense = (x.double() @ w.bfloat16().double().t()).float()
    torch.testing.assert_close(copy.matmul(x), dense, rtol=1e-5, atol=1e-5 * float(dense.abs().max()))
    assert q.quantize_q8(w, backend.q8_linear).tiles_from == q.ALL_ROWS


def _q4_1_checkpoint(src, dst):
    """A copy of the tiny model whose decoder weights are Q4_1 values (as a converted GGUF's are)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for i, (name, t) in enumerate(sorted(tensors.items())):
            if name.startswith("model.layers.") and t.dim() == 2:
                tensors[name] = q4_1_values(*t.shape, seed=i).to(t.dtype)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                tensors[name] = q8_0_values(*t.shape, seed=i).to(t.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


def test_load_auto_quantizes_only_a_4bit_checkpoint(tiny_model_dir, tmp_path):
    plain = load_model(tiny_model_dir, "float32", quantization="auto")
    assert all(m.int4 is None for m in plain.decoder_linears())
    q4_dir = _q4_1_checkpoint(tiny_model_dir, tmp_path / "q4")
    model = load_model(q4_dir, "float32", quantization="auto", int4_max_rows=8)
    linears = model.decoder_linears()
    assert all(m.int4 is not None and m.int4.max_rows == 8 for m in linears)
    assert all(m.weight.dtype == torch.float32 for m in linears)
    assert q.on_4bit_grid(linears[0].weight.data)  # the dense copy keeps the checkpoint's values
    assert model.head_int8 is not None and model.head_int8.max_rows == 8
    assert plain.head_int8 is None


def test_the_head_uses_its_int8_copy_only_up_to_max_rows(tiny_model_dir, tmp_path):
    q4_dir = _q4_1_checkpoint(tiny_model_dir, tmp_path / "q4")
    model = load_model(q4_dir, "float32", quantization="auto", int4_max_rows=2)
    head = model.head_int8
    x = torch.randn(4, head.in_features)
    dense = torch.nn.functional.linear(x, model.head_weight())
    calls, matmul = [], head.matmul
    head.matmul = lambda x: calls.append(x.shape[0]) or matmul(x)
    with torch.no_grad():
        small, large = model.logits(x[:2]), model.logits(x)
    assert calls == [2]  # the 4-row call went to the dense head
    # Q8_0 values: the same head (within the int8 input rounding where q8_linear runs it)
    tol = 1e-4 if isinstance(head, q.Int8Weight) else 0.02 * float(dense.abs().max())
    assert torch.allclose(small, dense[:2], rtol=1e-4, atol=tol)
    assert torch.equal(large, dense)


def test_step_forward_equals_forward_and_reuses_its_buffer_for_few_rows():
    from kernels.cpu.backend import backend
    from services.executor.models import llama

    cpu = backend()
    if cpu is None:
        pytest.skip("the C++ CPU kernels did not build")
    lin = Linear(128, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(q4_1_values(64, 128))
    lin.int4 = q.quantize_q4(lin.weight.data, cpu.q4_linear)
    lin.int4.max_rows = 64
    x = torch.randn(40, 128)
    with torch.inference_mode():
        for n in (1, 3, llama.REUSED_ROWS, llama.REUSED_ROWS + 1, 40):
            fresh, kept = lin.forward(x[:n]), lin.step_forward(x[:n])
            assert torch.equal(kept, fresh), n
            assert (kept.data_ptr() == lin._out.data_ptr()) == (n <= llama.REUSED_ROWS), n
        first = lin.step_forward(x[:2]).clone()
        again = lin.step_forward(x[2:4])  # the same buffer: the earlier result is gone, as documented
        assert torch.equal(again, lin.forward(x[2:4])) and not torch.equal(again, first)


def test_scales_stay_float32_where_float16_would_round_them():
    """float16 scale and min where every one is 0 or a normal float16 (a third fewer bytes a step);
    a group of tiny weights (scale under float16's smallest normal) keeps float32, so that no
    group loses its precision, and the kernel gives the same product either way."""
    w = torch.randn(32, 64) * 0.02
    fp16 = q.quantize_q4(w, reference.q4_linear)
    assert fp16.d.dtype == fp16.m.dtype == torch.float16
    w[3, :32] *= 1e-4  # one group of tiny weights: its scale is a float16 subnormal
    kept = q.quantize_q4(w, reference.q4_linear)
    assert kept.d.dtype == kept.m.dtype == torch.float32
    codes, scale, low = q.q4_1_codes(w)
    assert torch.equal(kept.d.transpose(1, 2).reshape(32, 2), scale.squeeze(-1))
    ext = load_cpu_kernels()
    if ext is not None:
        x = torch.randn(5, 64)
        half, full = torch.empty(5, 32), torch.empty(5, 32)
        ext.q4_linear(half, x, fp16.packed, fp16.d, fp16.m)
        ext.q4_linear(full, x, fp16.packed, fp16.d.float(), fp16.m.float())
        assert torch.equal(half, full)  # float16 scales widen exactly
