// What the two chunk attention kernels share (amx_attention.cpp on AMX tiles,
// avx512_attention.cpp on AVX512-BF16 dot products): the entry points' argument checks, the
// context's keys and values packed per KV head in the layouts both multiply by, and the order
// of the work items.
//
// Both kernels compute causal attention of one long bfloat16 query chunk (head_dim 64) at
// positions ctx_len - q_len .. ctx_len - 1 over its paged context. The packed layouts are the
// AMX tile unit's B operands, which are also what vdpbf16ps wants for 16 keys (or 16
// dimensions) per register:
//   keys:   [key groups of 16][32 dimension pairs][16 keys] dwords (K transposed, pairs in rows)
//   values: [key-pair groups of 32 keys][4 chunks of 16 dims][16 key pairs][16 dims] dwords
// so one 64-byte row is 16 keys' (or 16 dimensions') pair of bfloat16 values.
#pragma once

#include "common.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_CHUNK_PACKING 1
#include <immintrin.h>
#endif

namespace pagedserve::chunk {

constexpr int64_t D = 64;          // head_dim the kernels take
constexpr int64_t kKeyBlock = 64;  // the packed context is padded to whole blocks of this many keys

// The checks both entry points make; returns the block table as contiguous int64 ids.
inline at::Tensor check_args(const char* name, const at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t ctx_len) {
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              name, " takes bfloat16 queries and caches");
  TORCH_CHECK(query.dim() == 3 && query.size(2) == D && query.stride(2) == 1 && query.stride(1) == D,
              "query must be [q_len, heads, 64] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == D, "out must match query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes(), "caches must be contiguous [blocks, block_size, kv_heads, 64]");
  const int64_t q_len = query.size(0), heads = query.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q_len >= 1 && q_len <= ctx_len, "a chunk of ", q_len, " tokens cannot end a context of ", ctx_len);
  auto table = block_table.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 1, "block_table must be one sequence's block ids");
  check_block_table(table.data_ptr<int64_t>(), table.numel(), ctx_len, k_cache.size(1), k_cache.size(0), 0);
  return table;
}

// Work item i of a call (16-row tiles x query heads) as (query head, first row): KV head by KV
// head, so both threads read the same packed keys and values from cache, and the last tiles
// first, since a causal tile's work grows with its position.
struct Item {
  int64_t head, row;
};
inline Item item_at(int64_t i, int64_t tiles, int64_t group, int64_t rows_per_tile) {
  const int64_t g = i / (tiles * group), rest = i % (tiles * group);
  return {g * group + rest % group, (tiles - 1 - rest / group) * rows_per_tile};
}

#ifdef PAGEDSERVE_CHUNK_PACKING

// 2^x for x <= 0: the fraction x - floor(x) in one vreduceps, 2^fraction by a degree-4
// polynomial (relative error 3e-6, far below the bfloat16 the probabilities are rounded to),
// times 2^floor(x) by vscalefps. A masked score's -inf gives exactly 0 (vreduceps(-inf) = 0,
// vscalefps(p, -inf) = 0); the kernels run with denormals flushed, so x < -126 gives 0 as well.
inline __m512 exp2_ps(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.013520603197212518f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05203742877442222f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2414274932511992f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6930066206638739f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000002518130136f));
  return _mm512_scalef_ps(p, x);
}

// Flush-to-zero and denormals-are-zero on this thread while it lives (exp2_ps relies on it).
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_;
};

// One KV head's context in the layouts above.
struct PackedKV {
  uint32_t* keys;  // written for the whole context; the last 64-key block zero past its end
  uint32_t* values;
};

// Keys [begin, end) of KV head h into `p` (begin even; keys past the context stay as the caller zeroed them).
inline void pack_slab(PackedKV& p, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t begin,
                      int64_t end, int64_t ctx_len, int64_t block_size, int64_t kv_heads, int64_t h) {
  const int64_t row_stride = kv_heads * D;
  auto key_row = [&](const uint16_t* cache, int64_t pos) {
    return cache + ((table[pos / block_size] * block_size + pos % block_size) * row_stride + h * D);
  };
  for (int64_t pos = begin; pos < end; ++pos) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(key_row(kc, pos));
    uint32_t* dst = p.keys + (pos / 16) * (D / 2) * 16 + pos % 16;
    for (int64_t pair = 0; pair < D / 2; ++pair) dst[pair * 16] = k[pair];
  }
  // value pairs: (key 2r, key 2r+1) of each dimension, interleaved
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t pos = begin; pos < end; pos += 2) {
    const uint16_t* a = key_row(vc, pos);
    const uint16_t* b = pos + 1 < ctx_len ? key_row(vc, pos + 1) : nullptr;
    uint32_t* dst = p.values + (pos / 32) * (D / 16) * 256 + ((pos % 32) / 2) * 16;
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i va = _mm512_loadu_si512(a + half * 32);
      const __m512i vb = b ? _mm512_loadu_si512(b + half * 32) : zero;
      _mm512_storeu_si512(dst + (2 * half) * 256, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(dst + (2 * half + 1) * 256, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// Every KV head's context packed, in 512-key slabs on `threads` threads, into a buffer kept between
// calls (per calling thread: fresh pages for every call cost their first-touch faults) and aligned to
// cache lines (a 64-byte row split over two lines costs two loads; malloc's large blocks start 16
// bytes into a page).
inline std::vector<PackedKV> pack_context(const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
                                          int64_t ctx_len, int threads) {
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t ctx_pad = (ctx_len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  static thread_local std::vector<uint32_t> arena;
  const int64_t per_head = ctx_pad * D / 2;
  if (static_cast<int64_t>(arena.size()) < 2 * kv_heads * per_head + 16) arena.resize(2 * kv_heads * per_head + 16);
  uint32_t* base = arena.data() + (16 - (reinterpret_cast<uintptr_t>(arena.data()) % 64) / 4) % 16;
  std::vector<PackedKV> packed(kv_heads);
  for (int64_t h = 0; h < kv_heads; ++h) {
    PackedKV& p = packed[h];
    p.keys = base + 2 * h * per_head;
    p.values = p.keys + per_head;
    std::memset(p.keys + (ctx_pad - kKeyBlock) * D / 2, 0, kKeyBlock * D * 2);
    std::memset(p.values + (ctx_pad - kKeyBlock) * D / 2, 0, kKeyBlock * D * 2);
  }
  constexpr int64_t kSlab = 512;
  const int64_t slabs = (ctx_len + kSlab - 1) / kSlab;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < kv_heads * slabs; ++i) {
    const int64_t h = i / slabs, begin = (i % slabs) * kSlab;
    pack_slab(packed[h], kc, vc, table, begin, std::min(ctx_len, begin + kSlab), ctx_len, block_size, kv_heads, h);
  }
  return packed;
}

#endif  // PAGEDSERVE_CHUNK_PACKING

}  // namespace pagedserve::chunk
