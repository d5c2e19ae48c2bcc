"""What a serving benchmark on this machine is bounded by: the CPU, its vector and matrix
instructions, torch's threads, and the GEMM rate torch reaches for a model's shapes.

`gemm_rate` times `F.linear` of `rows` activations by a weight of the model's MLP shape
(intermediate x hidden), the bulk of a decoder's matmuls, and returns GFLOP/s
(2 x rows x in x out per call). `matmul_params` counts the weights a token multiplies by
(every decoder Linear and the LM head): a decode step of B tokens does 2 x B x that many
FLOPs, so GEMM rate / (2 x params) is the tok/s those matmuls allow. `prefill_ceiling` is
the prompt tok/s the best rate allows with attention's FLOPs counted too.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

FLAG_GROUPS = {"AVX2": ("avx2",), "AVX-512": ("avx512f",), "AVX512-BF16": ("avx512_bf16",),
               "AVX512-VNNI": ("avx512_vnni",), "AMX": ("amx_tile", "amx_bf16")}


def cpu_info() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "x86_64", ""):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    have = {name: all(f in flags for f in need) for name, need in FLAG_GROUPS.items()}
    return {"model": model, "cores": os.cpu_count(), "features": have,
            "summary": ", ".join(name if ok else f"no {name}" for name, ok in have.items()),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def gemm_rate(rows: int, in_features: int, out_features: int, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """GFLOP/s of `F.linear` on (rows x in) by (out x in), median of repeated timings."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    for _ in range(3):
        F.linear(x, w)
    times: list[float] = []
    budget = time.perf_counter() + seconds
    while time.perf_counter() < budget or len(times) < 5:
        start = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * rows * in_features * out_features / times[len(times) // 2] / 1e9


def matmul_params(config) -> int:
    """Weights a token is multiplied by: attention and MLP projections of every layer, and the LM head."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter
    return config.num_hidden_layers * per_layer + config.vocab_size * hidden


def head_params(config) -> int:
    """Weights of the LM head: only tokens that are sampled go through it, prompt tokens do not."""
    return config.vocab_size * config.hidden_size


def workload_ceiling(gemm: list[dict], head: int, prompt_per_output: float, rows: int = 64) -> float | None:
    """Output tok/s the GEMM rate allows when every output token also brings `prompt_per_output`
    prompt tokens to prefill. Decode rows run at the best rate measured at `rows` rows; prompt rows
    (all matmuls but the LM head) at the best rate measured at any size, since prefill batches are
    large: of the two readings this is the higher ceiling."""
    at_rows = [g for g in gemm if g["rows"] == rows]
    if not at_rows:
        return None
    decode = max(g["gflops"] for g in at_rows) * 1e9
    prefill = max(g["gflops"] for g in gemm) * 1e9
    params = at_rows[0]["matmul_params"]
    return 1.0 / (2 * params / decode + prompt_per_output * 2 * (params - head) / prefill)


def gemm_table(config, rows: tuple[int, ...] = (64, 1024), dtypes=(torch.float32, torch.bfloat16),
               seconds: float = 0.3) -> list[dict]:
    """GEMM rate at each (rows, dtype) on the model's MLP shape, with the tok/s it allows."""
    params = matmul_params(config)
    out = []
    for dtype in dtypes:
        for r in rows:
            rate = gemm_rate(r, config.hidden_size, config.intermediate_size, dtype, seconds)
            out.append({"dtype": str(dtype).removeprefix("torch."), "rows": r, "gflops": rate,
                        "shape": [config.intermediate_size, config.hidden_size], "matmul_params": params,
                        "tok_s_ceiling": rate * 1e9 / (2 * params)})
    return out


def attention_flops_per_token(config, prompt_len: float) -> float:
    """QK^T and PV of one prompt token, averaged over a causal prompt of `prompt_len` tokens."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2.0 * config.num_hidden_layers * config.num_attention_heads * head_dim * prompt_len


def prefill_ceiling(gemm: list[dict], head: int, config, prompt_len: float) -> float | None:
    """Prompt tok/s the best GEMM rate measured allows on prompts of `prompt_len` tokens: every
    matmul but the LM head, and attention, at that rate."""
    if not gemm:
        return None
    rate = max(g["gflops"] for g in gemm) * 1e9
    return rate / (2.0 * (gemm[0]["matmul_params"] - head) + attention_flops_per_token(config, prompt_len))
