"""LoRA deltas of one projection for rows under several adapters at once, in Triton (CUDA).

The CUDA counterpart of the C++ CPU kernel (kernels/cpu/csrc/lora.cpp) on the same inputs
(`kernels.lora_stacked`): the slots' A side by side in a stacked A [R, in] and their B^T in
B^T [R, out], the step's rows grouped by slot (`rows`: row indices, a group's rows together;
`groups` [G, 4]: a group's rows [begin, end) in `rows` and its slot's columns [begin, end) of
R). For each row i under slot s, out[i] += (x[i] @ A_s^T) @ B_s^T, in two kernels:

- shrink: s[j] = x[rows[j]] @ A_s^T for a group's rows, into a float32 buffer [splits, rows,
  widest slot]. Grid (groups, row tiles, splits x rank tiles). The in_features are cut into
  `splits` chunks that depend on in_features alone (not on the batch), so a decode step of few
  rows still spreads over the GPU, and a row's sums are added in the same order whatever batch
  it is in (no atomics).
- expand: out[rows[j]] += (sum of s[:, j]) @ B_s^T. Grid (groups, row tiles, output tiles); the
  rows of different groups are different rows, so every output element has one writer.

Accumulation is in float32; the expand's dot takes s in the weights' dtype (as the torch form's
second matmul does) unless the weights are float32 or the kernel runs in Triton's interpreter,
where every dot is float32 (`kernels.triton_utils`). A group's tiles past its rows and a slot
without columns on this projection return at once; base rows are in no group and untouched.
Grids come from host-side sizes (`TritonGroups`: the step's largest group and widest slot),
which the executor knows from the step it prepared, so a call reads nothing back from the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.lora_stacked import StackedTarget
from kernels.triton_utils import dot, dot_size, dots_in_fp32

BLOCK_K = 64  # in_features per step of the shrink's loop
BLOCK_N = 64  # out_features per expand program
MAX_BLOCK_M = 64  # rows per program, fewer for small groups (tl.dot's minimum, 16, at least)
MAX_BLOCK_R = 64  # a slot's columns per shrink program and per step of the expand's loop
K_PER_SPLIT = 1024  # in_features per shrink program, at least ...
MAX_SPLITS = 4  # ... so at most this many partial sums per row (the buffer: splits x rows x R floats)
# the expand's software pipelining: Triton's default 3 stages kept 139 KiB (bfloat16) and 176 KiB
# (float32) of shared memory at rank 192 with 4 splits (compiled for sm_80 and sm_90), past an
# sm_80's 163 KiB; 2 stages take 72 and 96 KiB (1 stage: 16 and 32)
EXPAND_STAGES = 2


class TritonGroups(NamedTuple):
    """One column layout's groups for the kernels, on the device, with the sizes of its grids."""

    groups: Tensor  # [G, 4] int64: rows [begin, end) in the step's `rows`, the slot's columns [begin, end)
    max_rows: int  # the largest group's rows
    max_cols: int  # the widest slot's columns in this layout


def triton_groups(rows: Tensor, groups: list[Tensor], device: torch.device) -> tuple[Tensor, list[TritonGroups]]:
    """`StackedLayouts.groups`' (rows, per-layout groups), host tensors, for the kernels on device."""
    out = []
    for g in groups:
        max_rows = int((g[:, 1] - g[:, 0]).max()) if len(g) else 0
        max_cols = int((g[:, 3] - g[:, 2]).max()) if len(g) else 0
        out.append(TritonGroups(g.to(device, non_blocking=True), max_rows, max_cols))
    return rows.to(device, non_blocking=True), out


def splits_of(in_features: int) -> tuple[int, int]:
    """(chunks of in_features, in_features per chunk, a multiple of BLOCK_K): from the shape alone."""
    splits = min(MAX_SPLITS, -(-in_features // K_PER_SPLIT))
    per = -(-in_features // splits)
    per = -(-per // BLOCK_K) * BLOCK_K
    return -(-in_features // per), per


@triton.jit
def _shrink_kernel(
    s_ptr, x_ptr, a_ptr, rows_ptr, groups_ptr,
    in_features, k_per_split, num_rows, width,
    stride_xm, stride_xk, stride_am, stride_ak,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, R_TILES: tl.constexpr,
    FP32: tl.constexpr,
):
    group = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2) // R_TILES
    r_tile = tl.program_id(2) % R_TILES
    row_end = tl.load(groups_ptr + group * 4 + 1)
    start = tl.load(groups_ptr + group * 4) + tile * BLOCK_M
    col_begin = tl.load(groups_ptr + group * 4 + 2)
    cols = tl.load(groups_ptr + group * 4 + 3) - col_begin
    if start >= row_end or r_tile * BLOCK_R >= cols:
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    x_rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)
    offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < cols
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xt = tl.load(x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_ptr + (col_begin + offs_r)[None, :] * stride_am + offs_k[:, None] * stride_ak,
                     mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # A^T's tile, [BLOCK_K, BLOCK_R]
        acc += dot(xt, at, FP32)
    s = s_ptr + split * num_rows * width + offs_m[:, None] * width + offs_r[None, :]
    tl.store(s, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    out_ptr, s_ptr, bt_ptr, rows_ptr, groups_ptr,
    out_features, num_rows, width,
    stride_om, stride_on, stride_bm, stride_bn,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32: tl.constexpr,
):
    group = tl.program_id(0)
    tile = tl.program_id(1)
    n_tile = tl.program_id(2)
    row_end = tl.load(groups_ptr + group * 4 + 1)
    start = tl.load(groups_ptr + group * 4) + tile * BLOCK_M
    col_begin = tl.load(groups_ptr + group * 4 + 2)
    cols = tl.load(groups_ptr + group * 4 + 3) - col_begin
    if start >= row_end or cols == 0:
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, cols, BLOCK_R):
        offs_r = r + tl.arange(0, BLOCK_R)
        mask_r = offs_r < cols
        mask_s = mask_m[:, None] & mask_r[None, :]
        st = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            st += tl.load(s_ptr + split * num_rows * width + offs_m[:, None] * width + offs_r[None, :],
                          mask=mask_s, other=0.0)
        bt = tl.load(bt_ptr + (col_begin + offs_r)[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc += dot(st, bt, FP32)
    out_rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)
    o = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask_o = mask_m[:, None] & mask_n[None, :]
    tl.store(o, (tl.load(o, mask=mask_o, other=0.0).to(tl.float32) + acc).to(out_ptr.dtype.element_ty),
             mask=mask_o)


def add_lora_stacked_triton(x: Tensor, out: Tensor, target: StackedTarget, rows: Tensor,
                            groups: TritonGroups) -> None:
    """out[rows of a group] += (x[those rows] @ A_slot^T) @ B_slot^T, in place, for every group
    (rows and groups: from `triton_groups`, the groups of the target's layout)."""
    num_groups = groups.groups.shape[0]
    if not num_groups or not groups.max_rows or not groups.max_cols:
        return
    in_features, out_features = target.a.shape[1], target.bt.shape[1]
    num_rows, width = rows.shape[0], groups.max_cols
    block_m = dot_size(min(groups.max_rows, MAX_BLOCK_M))
    block_r = dot_size(min(width, MAX_BLOCK_R))
    row_tiles, r_tiles = triton.cdiv(groups.max_rows, block_m), triton.cdiv(width, block_r)
    splits, k_per_split = splits_of(in_features)
    fp32 = dots_in_fp32(_shrink_kernel, target.a.dtype)
    s = torch.empty(splits, num_rows, width, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_groups, row_tiles, splits * r_tiles)](
        s, x, target.a, rows, groups.groups,
        in_features, k_per_split, num_rows, width,
        x.stride(0), x.stride(1), target.a.stride(0), target.a.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=BLOCK_K, R_TILES=r_tiles, FP32=fp32,
    )
    _expand_kernel[(num_groups, row_tiles, triton.cdiv(out_features, BLOCK_N))](
        out, s, target.bt, rows, groups.groups,
        out_features, num_rows, width,
        out.stride(0), out.stride(1), target.bt.stride(0), target.bt.stride(1),
        SPLITS=splits, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=BLOCK_N, FP32=fp32, num_stages=EXPAND_STAGES,
    )
