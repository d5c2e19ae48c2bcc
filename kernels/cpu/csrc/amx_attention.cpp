// Causal attention of one long query chunk over its paged context on AMX tiles (bfloat16,
// head_dim 64): the prefill path that torch's flash SDPA took before (~0.5 TFLOPS on two
// cores). kernels/cpu/chunk_kernels.py holds the Python entry and the torch reference the
// tests compare it with.
//
// Queries sit at positions ctx_len - q_len .. ctx_len - 1 and see keys up to their own
// position (and after pos - sliding_window when there is a window). First the context's
// keys and values are packed per KV head as the tile unit's B operands (chunk_attention.h).
// A work item is (query head, 16 query positions). It walks the keys in
// chunks of 512 whose float32 scores stay in L1: pass 1 multiplies its 16 x 64 query tile
// with the packed keys 64 at a time into those scores, masked, with each row's max; the
// accumulators are rescaled where a row's max grew since the last chunk; pass 2 turns the
// scores into exp2((s - max) * scale * log2 e) in bfloat16 and multiplies the packed values
// into four 16 x 16 accumulators held in tile registers for the chunk. Each row's sum
// divides it at the end. Items run on OpenMP threads, KV head by KV head and longest first;
// each thread keeps its tile configuration for the whole call.
#include "amx_tiles.h"
#include "chunk_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef PAGEDSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedserve {

#ifdef PAGEDSERVE_AMX
namespace {

using chunk::D;
using chunk::exp2_ps;
using chunk::kKeyBlock;  // keys per step of either pass
using amx::configure_tiles;
using chunk::PackedKV;
constexpr int64_t kRows = 16;      // query positions per item (a tile's rows)
constexpr int64_t kChunk = 512;    // keys whose scores are held at once (32 KB: L1)

// Linux hands out the tile registers' state only to a process that asks (once).
bool request_tile_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct Scratch {
  alignas(64) float scores[kRows * kChunk];                // one chunk's scores, block by block [16 rows][64 keys]
  alignas(64) uint16_t q[kRows * D];
  alignas(64) uint16_t p[2][kRows * kKeyBlock];  // two blocks' probabilities: one in the tiles' reads, one being written
  alignas(64) float o[kRows * D];                          // the accumulators between chunks
};

// One item: 16 positions of query head `head` (rows past the chunk's end are zero and dropped).
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
  const float ninf_f = -std::numeric_limits<float>::infinity();
  const __m512 ninf = _mm512_set1_ps(ninf_f);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const float c = scale * 1.44269504088896341f;
  const __m512 cv = _mm512_set1_ps(c);
  __m512 mx[kRows], neg_max[kRows], sum[kRows];
  float row_max[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    row_max[r] = ninf_f;
    sum[r] = _mm512_setzero_ps();
  }

  // each row's max over a block of stored scores, masking first where some row sees only part of it
  auto block_max = [&](int64_t kb, float* blk) {
    const bool masked = kb + kKeyBlock - 1 > first_pos || kb + kKeyBlock > ctx_len ||
                        (window && kb <= first_pos + kRows - 1 - window);
    for (int64_t r = 0; r < kRows; ++r) {
      float* row = blk + r * kKeyBlock;
      __m512 m = mx[r];
      for (int64_t q = 0; q < kKeyBlock; q += 16) {
        __m512 v = _mm512_load_ps(row + q);
        if (masked) {
          const int64_t pos = first_pos + r;
          const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(kb + q)), lane);
          __mmask16 hide = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(pos)));
          hide |= _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(ctx_len)));
          if (window)
            hide |= _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(pos - window)));
          v = _mm512_mask_mov_ps(v, hide, ninf);
          _mm512_store_ps(row + q, v);
        }
        m = _mm512_max_ps(m, v);
      }
      mx[r] = m;
    }
  };
  auto probabilities = [&](const float* blk, uint16_t* p_out) {
    for (int64_t r = 0; r < kRows; ++r) {
      const float* row = blk + r * kKeyBlock;
      __m512 p[4];
      for (int64_t q = 0; q < 4; ++q) {
        p[q] = exp2_ps(_mm512_fmadd_ps(_mm512_load_ps(row + 16 * q), cv, neg_max[r]));
        sum[r] = _mm512_add_ps(sum[r], p[q]);
      }
      _mm512_store_si512(p_out + r * kKeyBlock, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
      _mm512_store_si512(p_out + r * kKeyBlock + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
    }
  };

  // The keys in chunks whose scores stay in L1 (through L2 they cost 4x the stores): per chunk,
  // pass 1 (scores and each row's max; a block's max runs while the tile unit computes the next),
  // the accumulators rescaled where a row's max grew, then pass 2 (probabilities in bfloat16 times
  // the values, accumulated in tiles 2..5; the next block's probabilities are computed while the
  // tile unit multiplies this one's).
  for (int64_t cs = k_begin; cs < k_end; cs += kChunk) {
    const int64_t ce = std::min(k_end, cs + kChunk);
    _tile_loadd(0, s.q, D * 2);
    _tile_loadd(1, s.q + 32, D * 2);
    for (int64_t r = 0; r < kRows; ++r) mx[r] = ninf;
    for (int64_t kb = cs; kb < ce; kb += kKeyBlock) {
      const uint32_t* kp = kv.keys + (kb / 16) * 512;
      float* dst = s.scores + (kb - cs) * kRows;
      _tile_zero(2);
      _tile_zero(3);
      _tile_zero(4);
      _tile_zero(5);
      _tile_loadd(6, kp, 64);
      _tile_dpbf16ps(2, 0, 6);
      _tile_loadd(7, kp + 256, 64);
      _tile_dpbf16ps(2, 1, 7);
      _tile_loadd(6, kp + 512, 64);
      _tile_dpbf16ps(3, 0, 6);
      _tile_loadd(7, kp + 768, 64);
      _tile_dpbf16ps(3, 1, 7);
      _tile_loadd(6, kp + 1024, 64);
      _tile_dpbf16ps(4, 0, 6);
      _tile_loadd(7, kp + 1280, 64);
      _tile_dpbf16ps(4, 1, 7);
      _tile_loadd(6, kp + 1536, 64);
      _tile_dpbf16ps(5, 0, 6);
      _tile_loadd(7, kp + 1792, 64);
      _tile_dpbf16ps(5, 1, 7);
      if (kb > cs) block_max(kb - kKeyBlock, dst - kRows * kKeyBlock);
      _tile_stored(2, dst, kKeyBlock * 4);
      _tile_stored(3, dst + 16, kKeyBlock * 4);
      _tile_stored(4, dst + 32, kKeyBlock * 4);
      _tile_stored(5, dst + 48, kKeyBlock * 4);
    }
    block_max(ce - kKeyBlock, s.scores + (ce - kKeyBlock - cs) * kRows);
    for (int64_t r = 0; r < kRows; ++r) {
      const float m = std::max(row_max[r], _mm512_reduce_max_ps(mx[r]));
      if (cs > k_begin && m > row_max[r]) {  // earlier chunks' sums and values were scaled for a smaller max
        const __m512 alpha = exp2_ps(_mm512_set1_ps((row_max[r] - m) * c));
        sum[r] = _mm512_mul_ps(sum[r], alpha);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_store_ps(s.o + r * D + d, _mm512_mul_ps(_mm512_load_ps(s.o + r * D + d), alpha));
      }
      row_max[r] = m;
      neg_max[r] = _mm512_set1_ps(m == ninf_f ? 0.0f : -m * c);  // a row that sees none of these keys: all 0
    }
    if (cs == k_begin) {
      _tile_zero(2);
      _tile_zero(3);
      _tile_zero(4);
      _tile_zero(5);
    } else {
      _tile_loadd(2, s.o, D * 4);
      _tile_loadd(3, s.o + 16, D * 4);
      _tile_loadd(4, s.o + 32, D * 4);
      _tile_loadd(5, s.o + 48, D * 4);
    }
    probabilities(s.scores, s.p[0]);
    for (int64_t kb = cs, j = 0; kb < ce; kb += kKeyBlock, ++j) {
      const uint16_t* pb = s.p[j & 1];
      const uint32_t* vp = kv.values + (kb / 32) * 1024;
      _tile_loadd(0, pb, kKeyBlock * 2);
      _tile_loadd(1, pb + 32, kKeyBlock * 2);
      _tile_loadd(6, vp, 64);
      _tile_dpbf16ps(2, 0, 6);
      _tile_loadd(7, vp + 256, 64);
      _tile_dpbf16ps(3, 0, 7);
      _tile_loadd(6, vp + 512, 64);
      _tile_dpbf16ps(4, 0, 6);
      _tile_loadd(7, vp + 768, 64);
      _tile_dpbf16ps(5, 0, 7);
      _tile_loadd(6, vp + 1024, 64);
      _tile_dpbf16ps(2, 1, 6);
      _tile_loadd(7, vp + 1280, 64);
      _tile_dpbf16ps(3, 1, 7);
      _tile_loadd(6, vp + 1536, 64);
      _tile_dpbf16ps(4, 1, 6);
      _tile_loadd(7, vp + 1792, 64);
      _tile_dpbf16ps(5, 1, 7);
      if (kb + kKeyBlock < ce) probabilities(s.scores + (kb + kKeyBlock - cs) * kRows, s.p[(j + 1) & 1]);
    }
    _tile_stored(2, s.o, D * 4);
    _tile_stored(3, s.o + 16, D * 4);
    _tile_stored(4, s.o + 32, D * 4);
    _tile_stored(5, s.o + 48, D * 4);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum[r]));
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_load_ps(s.o + r * D + d), inv);
      const __m512 b = _mm512_mul_ps(_mm512_load_ps(s.o + r * D + d + 16), inv);
      _mm512_storeu_si512(out + r * out_stride + d, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

}  // namespace
#endif

bool amx_attention_available() {
#ifdef PAGEDSERVE_AMX
  static const bool ok = request_tile_permission();
  return ok;
#else
  return false;
#endif
}

void amx_chunk_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_table, int64_t ctx_len, double scale,
                         int64_t sliding_window) {
  TORCH_CHECK(amx_attention_available(), "amx_chunk_attention: this build or CPU has no AMX tiles");
#ifdef PAGEDSERVE_AMX
  const auto table = chunk::check_args("amx_chunk_attention", out, query, k_cache, v_cache, block_table, ctx_len);
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
    configure_tiles();
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      const auto [head, r0] = chunk::item_at(i, tiles, group, kRows);
      run_item(s, packed[head / group], q + r0 * query.stride(0) + head * D, query.stride(0),
               o + r0 * out.stride(0) + head * D, out.stride(0), first + r0, std::min(kRows, q_len - r0), ctx_len,
               fscale, sliding_window);
    }
    _tile_release();
  }
#endif
}

}  // namespace pagedserve
