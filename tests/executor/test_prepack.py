"""Prepacked weights (services.executor.prepack), oneDNN's and the AMX tiles', against F.linear, and where
they apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.build import load
from services.executor.model_runner import ModelRunner
from services.executor.prepack import (
    PACKED_MAX_ROWS,
    TILES_MAX_ROWS,
    attach_packed,
    pack,
    packed_or_dense,
    supported,
)
from services.executor.quantization import ALL_ROWS
from shared.messages import ExecuteStep, ScheduledSeq, SeqSampling

needs_bf16_onednn = pytest.mark.skipif(supported(torch.bfloat16, "cpu") is not None,
                                       reason=f"no packing here: {supported(torch.bfloat16, 'cpu')}")
_ext = load()
TILES = None
if _ext is not None and _ext.q4_linear_tiles_rows():
    from kernels.cpu.backend import make_backend

    TILES = make_backend(_ext).bf16_linear_tiles
needs_tiles = pytest.mark.skipif(TILES is None, reason="no AMX tiles here")
GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)
FUSED = ("q4_gate_up_silu_tiles", "bf16_gate_up_silu_tiles")


@pytest.mark.parametrize("kind", [pytest.param("onednn", marks=needs_bf16_onednn),
                                  pytest.param("tiles", marks=needs_tiles)])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 213, 512, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matmul_equals_linear(kind, rows, with_bias):
    """Either copy against F.linear, up to its max_rows; above them packed_or_dense is F.linear itself."""
    tiles = TILES if kind == "tiles" else None
    max_rows = TILES_MAX_ROWS if tiles else PACKED_MAX_ROWS
    if rows > max_rows:
        rows = max_rows + 1
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    packed = pack(w, b, tiles_op=tiles)
    assert packed.max_rows == max_rows and (packed.packed.dtype == torch.int32) == (kind == "tiles")
    if rows > max_rows:
        assert torch.equal(packed_or_dense(packed, x, w, b), F.linear(x, w, b))
        return
    got = packed.matmul(x).float()
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    # both round their bfloat16 output once; their float32 sums may differ in order only
    torch.testing.assert_close(got, want, atol=0.25, rtol=2e-2)
    torch.testing.assert_close(got, F.linear(x, w, b).float(), atol=0.25, rtol=2e-2)


@needs_bf16_onednn
def test_strided_input_and_large_calls():
    w = torch.randn(64, 48, dtype=torch.bfloat16)
    packed = pack(w)
    wide = torch.randn(10, 96, dtype=torch.bfloat16)
    x = wide[:, ::2]  # a non-contiguous view, as a projection's input can be
    torch.testing.assert_close(packed_or_dense(packed, x, w, None).float(), F.linear(x, w).float(), atol=0.1,
                               rtol=1e-2)
    big = torch.randn(PACKED_MAX_ROWS + 1, 48, dtype=torch.bfloat16)
    assert torch.equal(packed_or_dense(packed, big, w, None), F.linear(big, w))  # above max_rows: F.linear itself


def test_float32_and_other_devices_are_never_packed():
    assert supported(torch.float32, "cpu") is not None
    assert supported(torch.bfloat16, "meta") is not None


def _greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    bs, table = runner.block_size, list(range(1, 9))

    def seq(tokens, start):
        slots = [table[p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
        return ScheduledSeq(request_id="r", token_ids=tokens, start_pos=start, block_table=table,
                            slot_mapping=slots, sample=True, output_index=0, sampling=GREEDY)

    out = runner.execute(ExecuteStep(step_id=0, seqs=[seq(prompt, 0)]))
    for s in range(1, steps):
        out += runner.execute(ExecuteStep(step_id=s, seqs=[seq([out[-1]], len(prompt) + s - 1)]))
    return out


@needs_bf16_onednn
def test_runner_packs_bfloat16_and_keeps_its_tokens(tiny_model_dir):
    prompt = list(range(5, 40))
    packed = ModelRunner(tiny_model_dir, dtype="bfloat16", quantization="none", num_kv_blocks=16)
    plain = ModelRunner(tiny_model_dir, dtype="bfloat16", quantization="none", num_kv_blocks=16, prepack="none")
    assert all(m.packed is not None for m in packed.model.decoder_linears()) and packed.model.head_packed is not None
    assert all(m.packed is None for m in plain.model.decoder_linears()) and plain.model.head_packed is None
    assert _greedy(packed, prompt, 12) == _greedy(plain, prompt, 12)


@needs_tiles
@pytest.mark.parametrize("mode", ["tiles", "onednn"])
def test_runner_prepack_modes(tiny_model_dir, mode):
    """auto takes the tiles where the CPU has AMX; tiles and onednn force one layout; all keep the tokens."""
    prompt = list(range(5, 40))
    runner = ModelRunner(tiny_model_dir, dtype="bfloat16", quantization="none", num_kv_blocks=16, prepack=mode)
    tiles = [m.packed.tiles_op is not None for m in runner.model.decoder_linears()]
    assert tiles and all(tiles) == (mode == "tiles") and not any(tiles) == (mode == "onednn")
    plain = ModelRunner(tiny_model_dir, dtype="bfloat16", quantization="none", num_kv_blocks=16, prepack="none")
    assert _greedy(runner, prompt, 12) == _greedy(plain, prompt, 12)
    auto = ModelRunner(tiny_model_dir, dtype="bfloat16", quantization="none", num_kv_blocks=16)
    assert all(m.packed.tiles_op is not None for m in auto.model.decoder_linears())
    with pytest.raises(ValueError, match="prepack"):
        attach_packed(auto.model, "fast")


def test_exact_and_deterministic_modes_keep_plain_weights(tiny_model_dir):
    for runner in (ModelRunner(tiny_model_dir, dtype="float32", quantization="none", num_kv_blocks=16),
                   ModelRunner(tiny_model_dir, dtype="bfloat16", quantization="none", num_kv_blocks=16,
                               deterministic=True)):
        assert all(m.packed is None for m in runner.model.decoder_linears())
        assert runner.model.head_packed is None


@needs_tiles
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_gate_up_and_silu_in_one_tile_kernel_keep_the_tokens(tiny_model_dir, quantization):
    """Where the MLP's gate/up call runs on tiles (the dense tiles' copy; the int4 copies' tiles from 28
    rows), it and SiLU-and-mul run as one kernel (`Linear.gate_up_silu`), to the same tokens as the two
    ops in turn; other calls (the int4 copies' 1-row decode steps) keep the two ops."""
    prompt = list(range(5, 45))

    def runner(fused: bool) -> tuple[ModelRunner, list[str]]:
        r = ModelRunner(tiny_model_dir, dtype="bfloat16", quantization=quantization, num_kv_blocks=16)
        for m in r.model.decoder_linears():  # every call on the copies, from 28 rows on their tiles
            if m.int4 is not None:
                m.int4.max_rows, m.int4.tiles_from = ALL_ROWS, r.model.backend.q4_tiles_min_rows
        ops, calls = r.model.backend, []

        def counted(name):
            fn = getattr(ops, name)

            def call(*args):
                calls.append(name)
                return fn(*args)
            return call if fused else None

        r.model.backend = dataclasses.replace(ops, **{n: counted(n) for n in FUSED})
        return r, calls

    (fused, calls), (plain, none) = runner(True), runner(False)
    assert _greedy(fused, prompt, 12) == _greedy(plain, prompt, 12)
    layers = len(fused.model.model.layers)
    if quantization == "int4":
        assert calls == ["q4_gate_up_silu_tiles"] * layers  # the prompt step only
    else:
        assert calls == ["bf16_gate_up_silu_tiles"] * layers * 12
    assert none == []
