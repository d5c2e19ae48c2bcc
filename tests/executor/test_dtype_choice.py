"""`--dtype auto`: the fastest dtype the device really has, and the reason it logs."""

from __future__ import annotations

import logging

import pytest
import torch

from services.executor.dtype_choice import choose_dtype, resolve_dtype

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}


@pytest.mark.parametrize(("flags", "expected"), [
    (AVX2, torch.float32),  # no bfloat16 GEMM: emulated, several times slower
    (AVX512, torch.float32),  # AVX-512 without BF16 still emulates
    (AVX512 | {"avx512_bf16"}, torch.bfloat16),
    (AVX512 | {"amx_bf16", "amx_tile"}, torch.bfloat16),
    ({"asimd", "bf16"}, torch.bfloat16),
    ({"asimd"}, torch.float32),
])
def test_auto_on_the_cpu_follows_its_instructions(flags, expected):
    dtype, why = choose_dtype("auto", "cpu", flags=flags)
    assert dtype == expected
    assert "bfloat16" in why


def test_auto_on_cuda_is_bfloat16_unless_the_checkpoint_is_float16():
    assert choose_dtype("auto", "cuda")[0] == torch.bfloat16
    assert choose_dtype("auto", "cuda", checkpoint_dtype="float16")[0] == torch.float16
    assert choose_dtype("auto", "cuda", checkpoint_dtype="bfloat16")[0] == torch.bfloat16


def test_an_explicit_dtype_is_kept():
    for name in ("float32", "bfloat16", "float16"):
        assert choose_dtype(name, "cpu", flags=AVX2)[0] == getattr(torch, name)
    with pytest.raises(ValueError, match="unknown dtype"):
        choose_dtype("float8", "cpu")


def test_auto_logs_what_it_chose_and_why(caplog):
    with caplog.at_level(logging.INFO, logger="services.executor.dtype_choice"):
        dtype = resolve_dtype("auto", "cpu")
    assert f"dtype auto -> {str(dtype).removeprefix('torch.')}" in caplog.text


def test_the_kv_cache_follows_the_compute_dtype_unless_told():
    from services.executor.dtype_choice import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu") == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "torch") == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, "triton") == torch.bfloat16
    with pytest.raises(ValueError, match="Triton"):
        resolve_kv_cache_dtype("float32", torch.bfloat16, "triton")
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        resolve_kv_cache_dtype("fp8", torch.float32, "cpu")
