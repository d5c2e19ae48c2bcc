// The AMX linears (q4_amx.cpp), for bfloat16 rows: Q4_1 and Q8_0 copies (q4_linear_tiles, q8_linear_tiles)
// and dense bfloat16 weights prepacked in tiles (bf16_linear_tiles).
#pragma once

#include "common.h"

namespace pagedserve {

// Below this many rows q4_linear's integer path is faster, as every call dequantizes all the
// weights. Xeon with AMX, SmolLM2's 30 decoder layers from DRAM (benchmarks.quantized_linear_dram):
// integer path 5.7/6.7/7.8/8.8/10.5/20.5 ms at 16/20/24/28/32/64 rows, tiles 6.2/8.7/8.7/8.8/8.1/10.6.
constexpr int64_t kQ4AmxMinRows = 28;

// Whether q4_linear_amx runs x here: bfloat16 rows, an AMX build granted the tiles.
bool q4_amx_applies(const at::Tensor& x);

// The rows from which q4_linear_tiles beats q4_linear here (kQ4AmxMinRows); 0 where it cannot run.
int64_t q4_linear_tiles_rows();

// q4_linear's contract (arguments already checked by coded_linear); out float32 or bfloat16.
void q4_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                   const at::Tensor& mn);
// q4_linear_amx of a gate/up weight (the gate's N / 2 rows, then the up's) into out [M, N / 2] bfloat16:
// silu(gate) * up, as silu_and_mul rounds it.
void q4_gate_up_silu_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                         const at::Tensor& mn);
// The same for q8_linear's 8-bit codes (mn empty: Q8_0's m = -128 d).
void q8_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                   const at::Tensor& mn);

// out = x @ w.T for bfloat16 x and w prepacked by kernels.reference.pack_tiles; out bfloat16 or float32.
void bf16_linear_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed);
// bf16_linear_tiles then silu_and_mul for a gate/up weight (the gate's blocks, then the up's): out [M, N / 2].
void bf16_gate_up_silu_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed);

}  // namespace pagedserve
