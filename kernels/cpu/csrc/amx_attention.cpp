// Causal attention of one long query chunk over its paged context on AMX tiles (bfloat16,
// head_dim 64): the prefill path that torch's flash SDPA took before (~0.5 TFLOPS on two
// cores). kernels/cpu/chunk_kernels.py holds the Python entry and the torch reference the
// tests compare it with.
//
// Queries sit at positions ctx_len - q_len .. ctx_len - 1 and see keys up to their own
// position (and after pos - sliding_window when there is a window). First the context's
// keys and values are packed per KV head as the tile unit's B operands (chunk_attention.h).
// A work item is (query head, 16 query positions); it walks its keys 64 at a time, software-
// pipelined: the tile unit computes block b + 1's 16 x 64 scores (query rows in tiles 0-1) and
// multiplies block b - 1's bfloat16 probabilities by the packed values into four 16 x 16 output
// accumulators that stay in tiles 2-5 for the whole item, while block b's scores (in L1: two
// blocks' worth, where the 512-key chunks before spilled 32 KB of scores past L1 and their tile
// stores ran 4x slower) become exp2((s - max) * scale * log2 e) against each row's running max.
// That max is raised lazily: only where a score passes it by kLazyRescale (2^8 in probability)
// does the row take its block's max and its sum and accumulators get rescaled, the accumulators
// leaving the tiles for that; so a row's max is set by its first block and seldom moves. Each
// row's sum divides it at the end. Items run on OpenMP threads, KV head by KV head and longest
// first; each thread keeps its tile configuration for the whole call.
//
// On the 2-core AMX Xeon the tile unit and the AVX-512 units did not overlap (8 tile products
// next to 256 independent FMAs took the sum of their times), so the kernel's time is its tile
// work plus its vector work: at 1,800 tokens 1.6 ms of tiles and 1.7 ms of softmax for one
// layer's 9 heads. Against the 512-key chunks before: 0.94-0.98x the time at 1,800 tokens, 0.92-0.93x
// for 2,048 queries after 6,144 tokens (`python -m benchmarks.dense_prefill`'s shapes, alternated).
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
constexpr int64_t kRows = 16;  // query positions per item (a tile's rows)
// How far (log2 units) a block's scores may rise above a row's running max before the row's max,
// sum and accumulators are rescaled: probabilities up to 2^8, far inside bfloat16's and float32's range
constexpr float kLazyRescale = 8.0f;

// Linux hands out the tile registers' state only to a process that asks (once).
bool request_tile_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct Scratch {
  alignas(64) float scores[2][kRows * kKeyBlock];  // two blocks' scores [16 rows][64 keys]
  alignas(64) uint16_t p[2][kRows * kKeyBlock];    // two blocks' probabilities in bfloat16
  alignas(64) uint16_t q[kRows * D];
  alignas(64) float o[kRows * D];                  // the accumulators, when a rescale takes them out of the tiles
};

// Tiles: 0-1 the query rows (A), 2-5 the output accumulators (16 dims each) for the whole item,
// 6 a block's score accumulator (pass 1) or probabilities (pass 2, A), 7 keys or values (B).
inline void scores_block(const uint32_t* kp, float* dst) {
  for (int64_t g = 0; g < 4; ++g) {
    _tile_zero(6);
    _tile_loadd(7, kp + g * 512, 64);
    _tile_dpbf16ps(6, 0, 7);
    _tile_loadd(7, kp + g * 512 + 256, 64);
    _tile_dpbf16ps(6, 1, 7);
    _tile_stored(6, dst + g * 16, kKeyBlock * 4);
  }
}
inline void values_block(const uint32_t* vp, const uint16_t* pb) {
  for (int64_t kk = 0; kk < 2; ++kk) {
    _tile_loadd(6, pb + kk * 32, kKeyBlock * 2);
    const uint32_t* v = vp + kk * 1024;
    _tile_loadd(7, v, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(7, v + 256, 64);
    _tile_dpbf16ps(3, 6, 7);
    _tile_loadd(7, v + 512, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, v + 768, 64);
    _tile_dpbf16ps(5, 6, 7);
  }
}

// One item: 16 positions of query head `head` (rows past the chunk's end are zero and dropped).
void run_item(Scratch& s, const PackedKV& kv, const uint16_t* query, int64_t q_stride, uint16_t* out,
              int64_t out_stride, int64_t first_pos, int64_t rows, int64_t ctx_len, float scale, int64_t window) {
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t k_lo = window ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t k_hi = std::min(ctx_len, last_pos + 1);
  const int64_t k_begin = k_lo / kKeyBlock * kKeyBlock;
  const int64_t k_end = (k_hi + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t n_blocks = (k_end - k_begin) / kKeyBlock;

  for (int64_t r = 0; r < kRows; ++r) {
    if (r < rows)
      std::memcpy(s.q + r * D, query + r * q_stride, D * sizeof(uint16_t));
    else
      std::memset(s.q + r * D, 0, D * sizeof(uint16_t));
  }
  const float ninf_f = -std::numeric_limits<float>::infinity();
  const __m512 ninf = _mm512_set1_ps(ninf_f);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 cv = _mm512_set1_ps(scale * 1.44269504088896341f);
  float row_max[kRows];  // log2 units (scores times scale * log2 e)
  __m512 neg_max[kRows], limit[kRows], sum[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    row_max[r] = ninf_f;
    neg_max[r] = _mm512_setzero_ps();
    limit[r] = ninf;  // the first visible score of a row sets its max
    sum[r] = _mm512_setzero_ps();
  }

  // Block kb's scores to bfloat16 probabilities against each row's running max. A row whose
  // scores pass its max by kLazyRescale (or that had none yet) takes its block max instead, its sum
  // and accumulators scaled down to it: the accumulators leave the tiles for that (rare after a
  // row's first block) and come back.
  auto softmax_block = [&](int64_t kb, const float* blk, uint16_t* p_out) {
    const bool masked = kb + kKeyBlock - 1 > first_pos || kb + kKeyBlock > ctx_len ||
                        (window && kb <= first_pos + kRows - 1 - window);
    bool stored = false;
    for (int64_t r = 0; r < kRows; ++r) {
      const float* row = blk + r * kKeyBlock;
      __m512 v[4];
      __mmask16 over = 0;
      for (int64_t q = 0; q < 4; ++q) {
        v[q] = _mm512_mul_ps(_mm512_load_ps(row + 16 * q), cv);
        if (masked) {
          const int64_t pos = first_pos + r;
          const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(kb + 16 * q)), lane);
          __mmask16 hide = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(pos)));
          hide |= _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(ctx_len)));
          if (window)
            hide |= _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(pos - window)));
          v[q] = _mm512_mask_mov_ps(v[q], hide, ninf);
        }
        over |= _mm512_cmp_ps_mask(v[q], limit[r], _CMP_GT_OQ);
      }
      if (over) {
        const float m = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
        if (row_max[r] != ninf_f) {
          if (!stored) {
            _tile_stored(2, s.o, D * 4);
            _tile_stored(3, s.o + 16, D * 4);
            _tile_stored(4, s.o + 32, D * 4);
            _tile_stored(5, s.o + 48, D * 4);
            stored = true;
          }
          const __m512 alpha = _mm512_set1_ps(std::exp2(row_max[r] - m));
          sum[r] = _mm512_mul_ps(sum[r], alpha);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_store_ps(s.o + r * D + d, _mm512_mul_ps(_mm512_load_ps(s.o + r * D + d), alpha));
        }
        row_max[r] = m;
        neg_max[r] = _mm512_set1_ps(-m);
        limit[r] = _mm512_set1_ps(m + kLazyRescale);
      }
      __m512 p[4];
      for (int64_t q = 0; q < 4; ++q) {
        p[q] = exp2_ps(_mm512_add_ps(v[q], neg_max[r]));  // -inf (masked, or no max yet) gives 0
        sum[r] = _mm512_add_ps(sum[r], p[q]);
      }
      _mm512_store_si512(p_out + r * kKeyBlock, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
      _mm512_store_si512(p_out + r * kKeyBlock + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
    }
    if (stored) {
      _tile_loadd(2, s.o, D * 4);
      _tile_loadd(3, s.o + 16, D * 4);
      _tile_loadd(4, s.o + 32, D * 4);
      _tile_loadd(5, s.o + 48, D * 4);
    }
  };
  auto keys_at = [&](int64_t b) { return kv.keys + ((k_begin + b * kKeyBlock) / 16) * 512; };
  auto values_at = [&](int64_t b) { return kv.values + ((k_begin + b * kKeyBlock) / 32) * 1024; };

  // Software-pipelined, so the vector units turn block b's scores into probabilities while the tile
  // unit computes block b + 1's scores and multiplies block b - 1's probabilities by its values.
  _tile_loadd(0, s.q, D * 2);
  _tile_loadd(1, s.q + 32, D * 2);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  scores_block(keys_at(0), s.scores[0]);
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (b + 1 < n_blocks) scores_block(keys_at(b + 1), s.scores[(b + 1) & 1]);
    if (b > 0) values_block(values_at(b - 1), s.p[(b - 1) & 1]);
    softmax_block(k_begin + b * kKeyBlock, s.scores[b & 1], s.p[b & 1]);
  }
  values_block(values_at(n_blocks - 1), s.p[(n_blocks - 1) & 1]);
  _tile_stored(2, s.o, D * 4);
  _tile_stored(3, s.o + 16, D * 4);
  _tile_stored(4, s.o + 32, D * 4);
  _tile_stored(5, s.o + 48, D * 4);
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
