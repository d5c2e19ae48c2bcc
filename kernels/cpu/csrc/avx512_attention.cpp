// Causal attention of one long query chunk over its paged context with AVX512-BF16 dot
// products (vdpbf16ps; bfloat16, head_dim 64): the prefill path for CPUs that have those
// instructions but no AMX tiles (AMD Zen 4 and later, Intel Cooper Lake), where it replaces
// the two-pass paged kernel and torch's flash SDPA for long chunks.
// kernels/cpu/chunk_kernels.py holds the Python entry and the torch reference the tests
// compare it with.
//
// The context's keys and values are packed per KV head as in the AMX kernel
// (chunk_attention.h): one 64-byte row holds 16 keys' dimension pair, or 16 dimensions'
// key pair, which is what vdpbf16ps multiplies by a broadcast pair of the other operand. A work
// item is (query head, 16 query positions); it walks the keys in chunks of kChunk whose scores
// and probabilities stay in L1:
//   pass 1: 4 rows x 64 keys of scores at a time in 16 registers, 32 dimension pairs deep
//           (4 key loads and 4 query broadcasts per 16 vdpbf16ps), masked and maxed as stored;
//   the accumulators are rescaled where a row's max grew since the last chunk, and the scores
//   become exp2((s - max) * scale * log2 e), rounded to bfloat16;
//   pass 2: 4 rows x 64 dimensions of output in 16 registers over the chunk's key pairs
//           (4 value loads and 4 probability broadcasts per 16 vdpbf16ps).
// Each row's sum divides it at the end. Items run on OpenMP threads, KV head by KV head and
// longest first.
#include "chunk_attention.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace pagedserve {

#ifdef PAGEDSERVE_CHUNK_PACKING
namespace {

using chunk::D;
using chunk::exp2_ps;
using chunk::kKeyBlock;
using chunk::PackedKV;
constexpr int64_t kRows = 16;     // query positions per item
constexpr int64_t kChunk = 128;   // keys whose scores and probabilities are held at once (8 + 4 KB)
constexpr int64_t kBlockRows = 4;  // rows per register block of either pass
constexpr int64_t kPairs = D / 2;

struct Scratch {
  alignas(64) float scores[kRows * kChunk];  // [16 rows][kChunk keys]
  alignas(64) uint16_t p[kRows * kChunk];    // the probabilities in bfloat16, [16 rows][kChunk keys]
  alignas(64) uint16_t q[kRows * D];
  alignas(64) float o[kRows * D];            // the accumulators between chunks
};

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Scores of rows r0..r0+3 against the 64 keys from kb, stored at `dst` ([rows][kChunk]), masked where
// `masked`, with each row's max folded into mx.
inline void score_block(const uint32_t* q32, const uint32_t* kp, float* dst, int64_t r0, int64_t kb,
                        int64_t first_pos, int64_t ctx_len, int64_t window, bool masked, __m512* mx) {
  __m512 acc[kBlockRows][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < kPairs; ++pair) {
    __m512i k[4];
    for (int64_t g = 0; g < 4; ++g) k[g] = _mm512_load_si512(kp + g * 512 + pair * 16);
    for (int64_t r = 0; r < kBlockRows; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int32_t>(q32[(r0 + r) * kPairs + pair]));
      for (int64_t g = 0; g < 4; ++g) acc[r][g] = dot_pairs(acc[r][g], qb, k[g]);
    }
  }
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t r = 0; r < kBlockRows; ++r) {
    const int64_t pos = first_pos + r0 + r;
    __m512 m = mx[r0 + r];
    for (int64_t g = 0; g < 4; ++g) {
      __m512 v = acc[r][g];
      if (masked) {
        const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(kb + 16 * g)), lane);
        __mmask16 hide = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(pos)));
        hide |= _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(ctx_len)));
        if (window) hide |= _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(pos - window)));
        v = _mm512_mask_mov_ps(v, hide, ninf);
      }
      _mm512_store_ps(dst + r * kChunk + 16 * g, v);
      m = _mm512_max_ps(m, v);
    }
    mx[r0 + r] = m;
  }
}

// o[r0..r0+3] += p[r0..r0+3][0, keys) x the values of the key pairs from `pair0` (global index).
inline void accumulate_block(const uint16_t* p, const uint32_t* values, float* o, int64_t r0, int64_t pair0,
                             int64_t keys) {
  __m512 acc[kBlockRows][4];
  for (int64_t r = 0; r < kBlockRows; ++r)
    for (int64_t c = 0; c < 4; ++c) acc[r][c] = _mm512_load_ps(o + (r0 + r) * D + 16 * c);
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(p);
  for (int64_t kp = 0; kp < keys / 2; ++kp) {
    const int64_t pair = pair0 + kp;
    const uint32_t* vp = values + (pair / 16) * 1024 + (pair % 16) * 16;
    __m512i v[4];
    for (int64_t c = 0; c < 4; ++c) v[c] = _mm512_load_si512(vp + c * 256);
    for (int64_t r = 0; r < kBlockRows; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int32_t>(p32[(r0 + r) * (kChunk / 2) + kp]));
      for (int64_t c = 0; c < 4; ++c) acc[r][c] = dot_pairs(acc[r][c], pb, v[c]);
    }
  }
  for (int64_t r = 0; r < kBlockRows; ++r)
    for (int64_t c = 0; c < 4; ++c) _mm512_store_ps(o + (r0 + r) * D + 16 * c, acc[r][c]);
}

// One item: 16 positions of one query head (rows past the chunk's end are zero and dropped).
void run_item(Scratch& s, const PackedKV& kv, const uint16_t* query, int64_t q_stride, uint16_t* out,
              int64_t out_stride, int64_t first_pos, int64_t rows, int64_t ctx_len, float scale, int64_t window) {
  // keys any row sees: [k_lo, k_hi); whole 64-key blocks from k_begin
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t k_lo = window ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t k_hi = std::min(ctx_len, last_pos + 1);
  const int64_t k_begin = k_lo / kKeyBlock * kKeyBlock;
  const int64_t k_end = (k_hi + kKeyBlock - 1) / kKeyBlock * kKeyBlock;

  for (int64_t r = 0; r < kRows; ++r) {
    if (r < rows)
      std::memcpy(s.q + r * D, query + r * q_stride, D * sizeof(uint16_t));
    else
      std::memset(s.q + r * D, 0, D * sizeof(uint16_t));
  }
  std::memset(s.o, 0, sizeof(s.o));
  const auto* q32 = reinterpret_cast<const uint32_t*>(s.q);
  const float ninf_f = -std::numeric_limits<float>::infinity();
  const float c = scale * 1.44269504088896341f;
  const __m512 cv = _mm512_set1_ps(c);
  __m512 mx[kRows], sum[kRows];
  float row_max[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    row_max[r] = ninf_f;
    sum[r] = _mm512_setzero_ps();
  }

  for (int64_t cs = k_begin; cs < k_end; cs += kChunk) {
    const int64_t ce = std::min(k_end, cs + kChunk);
    for (int64_t r = 0; r < kRows; ++r) mx[r] = _mm512_set1_ps(ninf_f);
    for (int64_t kb = cs; kb < ce; kb += kKeyBlock) {
      // some row sees only part of this block: past its position, past the context, or before its window
      const bool masked = kb + kKeyBlock - 1 > first_pos || kb + kKeyBlock > ctx_len ||
                          (window && kb <= first_pos + kRows - 1 - window);
      for (int64_t r0 = 0; r0 < kRows; r0 += kBlockRows)
        score_block(q32, kv.keys + (kb / 16) * 512, s.scores + r0 * kChunk + (kb - cs), r0, kb, first_pos, ctx_len,
                    window, masked, mx);
    }
    const int64_t keys = ce - cs;
    for (int64_t r = 0; r < kRows; ++r) {
      const float m = std::max(row_max[r], _mm512_reduce_max_ps(mx[r]));
      if (cs > k_begin && m > row_max[r]) {  // earlier chunks' sums and values were scaled for a smaller max
        const __m512 alpha = exp2_ps(_mm512_set1_ps((row_max[r] - m) * c));
        sum[r] = _mm512_mul_ps(sum[r], alpha);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_store_ps(s.o + r * D + d, _mm512_mul_ps(_mm512_load_ps(s.o + r * D + d), alpha));
      }
      row_max[r] = m;
      const __m512 neg_max = _mm512_set1_ps(m == ninf_f ? 0.0f : -m * c);  // a row that sees none of these keys: 0
      const float* row = s.scores + r * kChunk;
      uint16_t* p_row = s.p + r * kChunk;
      for (int64_t k = 0; k < keys; k += 32) {
        const __m512 a = exp2_ps(_mm512_fmadd_ps(_mm512_load_ps(row + k), cv, neg_max));
        const __m512 b = exp2_ps(_mm512_fmadd_ps(_mm512_load_ps(row + k + 16), cv, neg_max));
        sum[r] = _mm512_add_ps(sum[r], _mm512_add_ps(a, b));
        _mm512_store_si512(p_row + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
      }
    }
    for (int64_t r0 = 0; r0 < kRows; r0 += kBlockRows) accumulate_block(s.p, kv.values, s.o, r0, cs / 2, keys);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum[r]));
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_load_ps(s.o + r * D + d), inv);
      const __m512 b = _mm512_mul_ps(_mm512_load_ps(s.o + r * D + d + 16), inv);
      _mm512_storeu_si512(out + r * out_stride + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
  }
}

}  // namespace
#endif

bool avx512_bf16_attention_available() {
#ifdef PAGEDSERVE_CHUNK_PACKING
  return true;
#else
  return false;
#endif
}

void avx512_bf16_chunk_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table, int64_t ctx_len,
                                 double scale, int64_t sliding_window) {
  TORCH_CHECK(avx512_bf16_attention_available(), "avx512_bf16_chunk_attention: this build has no AVX512-BF16");
#ifdef PAGEDSERVE_CHUNK_PACKING
  const auto table =
      chunk::check_args("avx512_bf16_chunk_attention", out, query, k_cache, v_cache, block_table, ctx_len);
  const int threads = std::max(1, at::get_num_threads());
  const std::vector<PackedKV> packed = chunk::pack_context(k_cache, v_cache, table.data_ptr<int64_t>(), ctx_len,
                                                           threads);
  const int64_t q_len = query.size(0), heads = query.size(1), group = heads / k_cache.size(2);
  const int64_t first = ctx_len - q_len;
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t tiles = (q_len + kRows - 1) / kRows;
  const int64_t n_items = tiles * heads;
  const float fscale = static_cast<float>(scale);
#pragma omp parallel num_threads(threads)
  {
    const chunk::FlushDenormals flush;
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      const auto [head, r0] = chunk::item_at(i, tiles, group, kRows);
      run_item(s, packed[head / group], q + r0 * query.stride(0) + head * D, query.stride(0),
               o + r0 * out.stride(0) + head * D, out.stride(0), first + r0, std::min(kRows, q_len - r0), ctx_len,
               fscale, sliding_window);
    }
  }
#endif
}

}  // namespace pagedserve
