// Python bindings of the CPU kernels (built by kernels/cpu/build.py with torch's extension tooling).
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

namespace pagedserve {
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& context_lens, double scale, int64_t sliding_window);
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void rope_and_cache(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads);
void int8_group_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales);
void q4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
               const at::Tensor& mn);
void q4_linear_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
               const at::Tensor& mn);
int64_t q4_linear_tiles_rows();
void q8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
               const at::Tensor& mn);
void q8_linear_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                     const at::Tensor& mn);
void argmax_rows(at::Tensor& out, const at::Tensor& logits);
void bf16_linear_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed);
void q4_gate_up_silu_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                           const at::Tensor& mn);
void bf16_gate_up_silu_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed);
bool amx_attention_available();
void amx_chunk_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, int64_t ctx_len, double scale, int64_t sliding_window);
bool avx512_bf16_attention_available();
void avx512_bf16_chunk_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table, int64_t ctx_len,
                                 double scale, int64_t sliding_window);
void lora_grouped(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                  const at::Tensor& blocks, const at::Tensor& rows, const at::Tensor& groups);
}  // namespace pagedserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &pagedserve::paged_attention, "paged attention over a block table (decode and prefill)");
  m.def("two_pass_attention", [] {
#if defined(__AVX512F__)
    return true;
#else
    return false;
#endif
  }, "whether paged_attention takes the AVX-512 two-pass path (head_dim 64/128, blocks of 16k tokens)");
  m.def("amx_attention", &pagedserve::amx_attention_available,
        "whether amx_chunk_attention runs here (an AMX build, and Linux granted the tile registers)");
  m.def("amx_chunk_attention", &pagedserve::amx_chunk_attention,
        "causal attention of one bfloat16 chunk (head_dim 64) over its paged context on AMX tiles");
  m.def("avx512_bf16_attention", &pagedserve::avx512_bf16_attention_available,
        "whether avx512_bf16_chunk_attention runs here (a build with AVX512-BF16)");
  m.def("avx512_bf16_chunk_attention", &pagedserve::avx512_bf16_chunk_attention,
        "causal attention of one bfloat16 chunk (head_dim 64) over its paged context with vdpbf16ps");
  m.def("rms_norm", &pagedserve::rms_norm, "out = weight * rms_norm(x)");
  m.def("fused_add_rms_norm", &pagedserve::fused_add_rms_norm, "residual += x; x = weight * rms_norm(residual)");
  m.def("silu_and_mul", &pagedserve::silu_and_mul, "out = silu(gate) * up");
  m.def("rope_and_cache", &pagedserve::rope_and_cache, "RoPE on q and k in place; k and v into the cache");
  m.def("int8_group_linear", &pagedserve::int8_group_linear, "x @ (scales per group of 32 * int8 weight).T");
  m.def("q4_linear", &pagedserve::q4_linear, "x @ w.T for a packed Q4_1 weight, rows quantized to int8 per group");
  m.def("q4_linear_tiles", &pagedserve::q4_linear_tiles,
        "q4_linear on AMX tiles: bfloat16 x times the weights dequantized to bfloat16");
  m.def("q4_linear_tiles_rows", &pagedserve::q4_linear_tiles_rows,
        "rows from which q4_linear_tiles beats q4_linear here; 0 where it cannot run");
  m.def("q8_linear", &pagedserve::q8_linear, "x @ w.T for packed 8-bit codes (w = d * c + m), rows quantized as q4_linear's");
  m.def("q8_linear_tiles", &pagedserve::q8_linear_tiles,
        "q8_linear on AMX tiles: bfloat16 x times the weights dequantized to bfloat16 (rows as q4_linear_tiles_rows)");
  m.def("bf16_linear_tiles", &pagedserve::bf16_linear_tiles,
        "bfloat16 x @ w.T on AMX tiles, w prepacked by kernels.reference.pack_tiles (an AMX build only)");
  m.def("q4_gate_up_silu_tiles", &pagedserve::q4_gate_up_silu_tiles,
        "q4_linear_tiles of a gate/up weight, then silu_and_mul, in one pass (out [rows, N / 2] bfloat16)");
  m.def("bf16_gate_up_silu_tiles", &pagedserve::bf16_gate_up_silu_tiles,
        "bf16_linear_tiles of a gate/up weight, then silu_and_mul, in one pass (out [rows, N / 2] bfloat16)");
  m.def("argmax_rows", &pagedserve::argmax_rows,
        "out[r] = the first index of row r's maximum (of its first NaN if any), as numpy's argmax");
  m.def("lora_grouped", &pagedserve::lora_grouped,
        "out[rows] += (x[rows] @ A_s^T) @ B_s^T per group of rows under one slot's columns of stacked A, B^T");
}

// The same kernels as dispatcher ops (torch.ops.pagedserve.*), for torch.compile: each names the
// arguments it writes (out, or the tensors updated in place), so functionalization keeps their order
// and inductor calls them in place. Their fake implementations live in kernels/custom_ops.py.
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor context_lens, float scale, int sliding_window) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rope_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("int8_group_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales) -> ()");
  m.def("q4_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor d, Tensor mn) -> ()");
  m.def("q4_linear_tiles(Tensor(a!) out, Tensor x, Tensor packed, Tensor d, Tensor mn) -> ()");
  m.def("q8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor d, Tensor mn) -> ()");
  m.def("q8_linear_tiles(Tensor(a!) out, Tensor x, Tensor packed, Tensor d, Tensor mn) -> ()");
  m.def("bf16_linear_tiles(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.def("q4_gate_up_silu_tiles(Tensor(a!) out, Tensor x, Tensor packed, Tensor d, Tensor mn) -> ()");
  m.def("bf16_gate_up_silu_tiles(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_attention", &pagedserve::paged_attention);
  m.impl("rms_norm", &pagedserve::rms_norm);
  m.impl("fused_add_rms_norm", &pagedserve::fused_add_rms_norm);
  m.impl("silu_and_mul", &pagedserve::silu_and_mul);
  m.impl("rope_and_cache", &pagedserve::rope_and_cache);
  m.impl("int8_group_linear", &pagedserve::int8_group_linear);
  m.impl("q4_linear", &pagedserve::q4_linear);
  m.impl("q4_linear_tiles", &pagedserve::q4_linear_tiles);
  m.impl("q8_linear", &pagedserve::q8_linear);
  m.impl("q8_linear_tiles", &pagedserve::q8_linear_tiles);
  m.impl("bf16_linear_tiles", &pagedserve::bf16_linear_tiles);
  m.impl("q4_gate_up_silu_tiles", &pagedserve::q4_gate_up_silu_tiles);
  m.impl("bf16_gate_up_silu_tiles", &pagedserve::bf16_gate_up_silu_tiles);
}
