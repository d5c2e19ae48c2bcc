"""Shared by the Triton kernel tests: where they run, their tolerances, and paged batches to run on.

Interpreted (the default here) the kernels run on CPU tensors with every dot in
float32, so an output differs from the float32 reference only by its own rounding:
less than one unit in the last place of its dtype (the interpreter truncates float32
to 16 bits rather than rounding). Compiled on a GPU, the probabilities go through the
cache dtype before the P @ V dot, as in any flash kernel, which costs a few units more.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.reference import paged_attention

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"

runnable = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                              reason="TRITON_INTERPRET=0 needs a CUDA GPU")

# (atol, rtol) for outputs against the float32 reference; rtol 2**-7 and 2**-10 are one ulp
TOLERANCE = {
    (torch.bfloat16, True): (1e-5, 2**-7),
    (torch.float16, True): (1e-5, 2**-10),
    (torch.bfloat16, False): (1e-2, 2e-2),
    (torch.float16, False): (2e-3, 4e-3),
}


def param_id(value) -> str | None:
    """Test ids that name dtypes (pytest's default is dtype0, dtype1...)."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[(actual.dtype, INTERPRETED)]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def build(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, extra_blocks=3, pad_columns=0):
    """seqs: (context_len, q_len) pairs. Each context lies on blocks drawn at random from a pool
    filled with noise (stale slots hold finite values, as in the executor's pool); block tables
    are padded with block 0, `pad_columns` more than needed. Returns the kernel inputs on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(needed) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(needed) + pad_columns, dtype=torch.long)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    q_lens = [q for _, q in seqs]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    return dict(
        query=query.to(DEVICE), k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).to(DEVICE),
        context_lens=torch.tensor([ctx for ctx, _ in seqs]).to(DEVICE),
    )


def reference(inputs, sliding_window=None, scale=None) -> torch.Tensor:
    """`kernels.reference.paged_attention` in float32 on the CPU, over the same (rounded) values."""
    cpu = {name: t.cpu() for name, t in inputs.items()}
    for name in ("query", "k_cache", "v_cache"):
        cpu[name] = cpu[name].float()
    return paged_attention(**cpu, scale=scale, sliding_window=sliding_window)


def live_slots(inputs) -> torch.Tensor:
    """[num_blocks, block_size] True where some sequence's context lies."""
    k_cache = inputs["k_cache"]
    block_size = k_cache.shape[1]
    live = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for row, ctx in zip(inputs["block_tables"].cpu(), inputs["context_lens"].tolist(), strict=True):
        for pos in range(ctx):
            live[row[pos // block_size], pos % block_size] = True
    return live.to(k_cache.device)
