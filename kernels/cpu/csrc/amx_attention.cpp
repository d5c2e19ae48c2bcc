// Causal attention of one long query chunk over its paged context on AMX tiles (bfloat16,
// head_dim 64): the prefill path that torch's flash SDPA took before (~0.5 TFLOPS on two
// cores). kernels/cpu/amx_attention.py holds the Python entry and the torch reference the
// tests compare it with.
//
// Queries sit at positions ctx_len - q_len .. ctx_len - 1 and see keys up to their own
// position (and after pos - sliding_window when there is a window). First the context's
// keys are packed per KV head as the tile unit's B operand (K transposed, dimension pairs
// in rows) and its values with key pairs in rows, in a cache-line-aligned buffer kept
// between calls. A work item is (query head, 16 query positions). It walks the keys in
// chunks of 512 whose float32 scores stay in L1: pass 1 multiplies its 16 x 64 query tile
// with the packed keys 64 at a time into those scores, masked, with each row's max; the
// accumulators are rescaled where a row's max grew since the last chunk; pass 2 turns the
// scores into exp2((s - max) * scale * log2 e) in bfloat16 and multiplies the packed values
// into four 16 x 16 accumulators held in tile registers for the chunk. Each row's sum
// divides it at the end. Items run on OpenMP threads, KV head by KV head and longest first;
// each thread keeps its tile configuration for the whole call.
#include "common.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedserve {

#ifdef PAGEDSERVE_AMX
namespace {

constexpr int64_t D = 64;         // head_dim this kernel takes
constexpr int64_t kRows = 16;     // query positions per item (a tile's rows)
constexpr int64_t kKeyBlock = 64;  // keys per step of either pass
constexpr int64_t kChunk = 512;    // keys whose scores are held at once (32 KB: L1)

// Linux hands out the tile registers' state only to a process that asks (once).
bool request_tile_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile is 16 rows of 64 bytes: A operands (16 x 32 bfloat16), B operands (16 pair rows x
// 16 columns) and float32 accumulators (16 x 16) alike.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// 2^x for x <= 0: the fraction x - floor(x) in one vreduceps, 2^fraction by a degree-4
// polynomial (relative error 3e-6, far below the bfloat16 the probabilities are rounded to),
// times 2^floor(x) by vscalefps. A masked score's -inf gives exactly 0 (vreduceps(-inf) = 0,
// vscalefps(p, -inf) = 0); the call runs with denormals flushed, so x < -126 gives 0 as well.
inline __m512 exp2_ps(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.013520603197212518f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05203742877442222f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2414274932511992f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6930066206638739f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000002518130136f));
  return _mm512_scalef_ps(p, x);
}

// The context's keys and values for one KV head in the tile unit's layouts.
//   keys:   [key groups of 16][2 halves of 16 dimension pairs][16 pair rows][16 keys] dwords
//   values: [key-pair groups of 32 keys][4 chunks of 16 dims][16 key-pair rows][16 dims] dwords
struct PackedKV {
  uint32_t* keys;  // written for the whole context; the last 64-key block zero past its end
  uint32_t* values;
};

// Keys [begin, end) of KV head h into `p` (begin even; keys past the context stay as the caller zeroed them).
void pack_slab(PackedKV& p, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t begin,
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
  // value pairs: (key 2r, key 2r+1) of each dimension, interleaved as the B operand wants
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
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "amx_chunk_attention takes bfloat16 queries and caches");
  TORCH_CHECK(query.dim() == 3 && query.size(2) == D && query.stride(2) == 1 && query.stride(1) == D,
              "query must be [q_len, heads, 64] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == D, "out must match query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes(), "caches must be contiguous [blocks, block_size, kv_heads, 64]");
  const int64_t q_len = query.size(0), heads = query.size(1);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q_len >= 1 && q_len <= ctx_len, "a chunk of ", q_len, " tokens cannot end a context of ", ctx_len);
  const auto table = block_table.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 1, "block_table must be one sequence's block ids");
  const int64_t* tab = table.data_ptr<int64_t>();
  check_block_table(tab, table.numel(), ctx_len, block_size, num_blocks, 0);

  const int64_t ctx_pad = (ctx_len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t group = heads / kv_heads;
  const int64_t first = ctx_len - q_len;
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  // kept between calls (per calling thread): fresh pages for every call cost their first-touch faults
  // and aligned to cache lines: a tile row split over two lines costs two loads (malloc's large blocks
  // start 16 bytes into a page)
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
  const int threads = std::max(1, at::get_num_threads());
  constexpr int64_t kSlab = 512;
  const int64_t slabs = (ctx_len + kSlab - 1) / kSlab;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < kv_heads * slabs; ++i) {
    const int64_t h = i / slabs, begin = (i % slabs) * kSlab;
    pack_slab(packed[h], kc, vc, tab, begin, std::min(ctx_len, begin + kSlab), ctx_len, block_size, kv_heads, h);
  }

  // items, last tiles first: a causal tile's work grows with its position
  const int64_t tiles = (q_len + kRows - 1) / kRows;
  const int64_t n_items = tiles * heads;
  const float fscale = static_cast<float>(scale);
#pragma omp parallel num_threads(threads)
  {
    const unsigned int mxcsr = _mm_getcsr();
    _mm_setcsr(mxcsr | 0x8040);  // flush-to-zero and denormals-are-zero while this call's threads run it
    configure_tiles();
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      // KV head by KV head, so both threads read the same packed keys and values from cache
      const int64_t g = i / (tiles * group), rest = i % (tiles * group);
      const int64_t t = tiles - 1 - rest / group, head = g * group + rest % group;
      const int64_t r0 = t * kRows, rows = std::min(kRows, q_len - r0);
      run_item(s, packed[head / group], q + r0 * query.stride(0) + head * D, query.stride(0),
               o + r0 * out.stride(0) + head * D, out.stride(0), first + r0, rows, ctx_len, fscale, sliding_window);
    }
    _tile_release();
    _mm_setcsr(mxcsr);
  }
#endif
}

}  // namespace pagedserve
