// Q4_1 (and Q8_0) linear on AMX tiles for steps of many rows (bfloat16 activations): each block of 16 output
// rows has its 4-bit weights dequantized once per call to bfloat16 (w = d * c + m, rounded as
// torch rounds float32 to bfloat16: the dense copy's weights) in the tile unit's
// pair-row layout, then every 16-row tile of the input multiplies them, 4 such tiles per pass; from
// kPairRows rows on, two blocks at a time times two row tiles, so each tile loaded feeds two products.
// The weights are read at 4 bits from memory instead of 16, and unlike q4_linear's integer path
// (whose per-row work grows with the rows) the multiply runs on the tile unit.
//
// The packed layout is q4_linear.cpp's: packed[block][g][h][lane][byte], low nibble input
// g*32 + h*4 + byte, high nibble input g*32 + (h+4)*4 + byte; d and m [block][g][lane]. Q8_0 heads
// (q8_linear_tiles) use its 8-bit layout: packed[block][g][h 0..7][lane][byte], input g*32 + h*4 + byte,
// codes c + 128 with m = -128 d where mn is empty.
//
// bf16_linear_tiles runs the same tile products on dense bfloat16 weights kept in that pair-row layout
// (--prepack auto on an AMX CPU): no dequantization, no reorder per call.
#include "q4_amx.h"

#include "amx_tiles.h"
#include "silu.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

namespace pagedserve {

#ifdef PAGEDSERVE_AMX
namespace {

constexpr int64_t kGroup = 32, kLanes = 16;
constexpr int64_t kTiles = 4;         // input row tiles per pass (accumulator tiles 0-3)
constexpr int64_t kRowChunk = 256;    // input rows whose bfloat16 values stay in L2 while a block is dequantized
// From this many rows, output blocks go in pairs (multiply_pair): in a step of 64 decode rows + a
// 150-token chunk (214 rows) SmolLM2's int4 matmuls took 36.9-38.6 ms that way against 41.9-45.5 one
// block at a time and oneDNN's 43.0-44.1 (`step_profile --prefill 150 --int4-rows 100000`,
// alternated, AMX Xeon); at 32 and 64 decode rows pairs were level with single blocks (11.1-11.3
// vs 11.6-11.8 ms, 15.9-16.4 vs 14.7-15.5).
constexpr int64_t kPairRows = 128;

// A 64-byte-aligned buffer of at least `count` T per thread and Slot, kept between calls (grown only):
// allocating it afresh each call cost page faults worth ~30% of a step's time at 20 rows. Aligned, as
// a tile row split across two cache lines loads slowly.
template <int Slot, typename T>
T* thread_scratch(int64_t count) {
  thread_local std::unique_ptr<T[], decltype(&std::free)> buf(nullptr, &std::free);
  thread_local int64_t capacity = 0;
  if (count > capacity) {
    buf.reset(static_cast<T*>(std::aligned_alloc(64, (count * sizeof(T) + 63) / 64 * 64)));
    capacity = count;
  }
  return buf.get();
}

// x's rows past its last whole 16-row tile, zero-padded to a tile (their results are dropped): the
// tile kernels read whole tiles in place and this one from here (copying all of x into a padded
// buffer took 0.2-0.6 ms of a ~4 ms layer at 1,800 rows).
inline const uint16_t* padded_tail(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t whole = M / 16 * 16;
  uint16_t* tail = thread_scratch<1, uint16_t>(16 * K);
  std::memset(tail, 0, 16 * K * sizeof(uint16_t));
  std::memcpy(tail, x + whole * K, (M - whole) * K * sizeof(uint16_t));
  return tail;
}

template <typename S>
inline __m512 load16(const S* p) {
  if constexpr (std::is_same_v<S, float>)
    return _mm512_loadu_ps(p);
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Word order turning (16 even inputs, 16 odd inputs) into 16 dwords of (even, odd) pairs.
alignas(64) constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Group g of a block as one B tile: row p holds inputs (g*32 + 2p, g*32 + 2p + 1) of each of the
// 16 outputs. Bits 8: mn null means Q8_0's m = -128 d.
template <int Bits, typename S>
inline void dequantize_group(const uint8_t* wg, const S* d, const S* mn, uint32_t* tile) {
  const __m512i order = _mm512_load_si512(kPairOrder);
  const __m512 dv = load16(d);
  auto pair = [&](__m512 even, __m512 odd, int64_t p) {
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
    _mm512_store_si512(tile + p * 16, _mm512_permutexvar_epi16(order, both));
  };
  if constexpr (Bits == 8) {
    // d * (c - 128) is exact in float32 for float16 d, as is d * c - 128 d: the dense copy's value
    const __m512 mv = mn ? load16(mn) : _mm512_mul_ps(dv, _mm512_set1_ps(-128.0f));
    const __m512i byte = _mm512_set1_epi32(0xFF);
    auto value = [&](__m512i v, int shift) {
      const __m512i c = _mm512_and_si512(_mm512_srli_epi32(v, shift), byte);
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), dv, mv);
    };
    for (int64_t h = 0; h < 8; ++h) {
      const __m512i v = _mm512_loadu_si512(wg + h * 64);
      pair(value(v, 0), value(v, 8), 2 * h);        // inputs 4h, 4h+1
      pair(value(v, 16), value(v, 24), 2 * h + 1);  // 4h+2, 4h+3
    }
    return;
  }
  const __m512i low4 = _mm512_set1_epi32(0xF);
  const __m512 mv = load16(mn);
  // with GGUF's float16 scales d * c is exact in float32, so this equals the dense copy's value
  auto value = [&](__m512i v, int shift) {
    const __m512i c = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(shift)), low4);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), dv, mv);
  };
  for (int64_t h = 0; h < 4; ++h) {
    const __m512i v = _mm512_loadu_si512(wg + h * 64);
    pair(value(v, 0), value(v, 8), 2 * h);        // inputs 4h, 4h+1
    pair(value(v, 16), value(v, 24), 2 * h + 1);  // 4h+2, 4h+3
    pair(value(v, 4), value(v, 12), 2 * h + 8);   // 4(h+4), +1
    pair(value(v, 20), value(v, 28), 2 * h + 9);  // 4(h+4)+2, +3
  }
}

// A block's packed weights and scales into L1 ahead of its dequantization.
inline void prefetch_block(const uint8_t* wp, const void* d, const void* mn, int64_t weight_bytes,
                           int64_t scale_bytes) {
  for (int64_t i = 0; i < weight_bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(wp + i), _MM_HINT_T0);
  for (int64_t i = 0; i < scale_bytes; i += 64) {
    _mm_prefetch(static_cast<const char*>(d) + i, _MM_HINT_T0);
    if (mn) _mm_prefetch(static_cast<const char*>(mn) + i, _MM_HINT_T0);
  }
}

// NT row tiles of x (16 rows each, row stride K) times one dequantized block, float32 into c [NT*16][16].
template <int Bits, int NT, typename S>
void multiply_block(const uint16_t* const* a, int64_t K, int64_t G, uint32_t* w, float* c, const uint8_t* wp,
                    const S* d, const S* mn) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  const int64_t stride = K * 2;
  for (int64_t g = 0; g < G; ++g) {
    // dequantized on the block's first pass, while the tile unit multiplies the group before
    if (wp) dequantize_group<Bits>(wp + g * Bits * 64, d + g * kLanes, mn ? mn + g * kLanes : nullptr, w + g * 256);
    _tile_loadd(4, w + g * 256, 64);
    _tile_loadd(5, a[0] + g * kGroup, stride);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (NT > 1) {
      _tile_loadd(6, a[1] + g * kGroup, stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (NT > 2) {
      _tile_loadd(5, a[2] + g * kGroup, stride);
      _tile_dpbf16ps(2, 5, 4);
    }
    if constexpr (NT > 3) {
      _tile_loadd(6, a[3] + g * kGroup, stride);
      _tile_dpbf16ps(3, 6, 4);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NT > 2) _tile_stored(2, c + 512, 64);
  if constexpr (NT > 3) _tile_stored(3, c + 768, 64);
}

// Bits for weights already in the tiles' layout (bf16_linear_tiles): multiply_pair only reads w0 and w1.
constexpr int kDense = 16;

// Cache lines [p, end) fetched into L2 a few at a time, `per_group` at each tile group of a product, so
// that DRAM streams the next block pair's weights in while the tile unit multiplies this one. Without it
// SmolLM2's 30 layers of dense tiles, weights from DRAM, took 1.16x the time at 214 rows and 1.09x at 512
// (level at 64; AMX Xeon). The int4 tiles' weights are a quarter the bytes: spread there it was level to
// slower (0.9x the time at 32 rows, 1.13x at 64), so they keep one burst a block ahead.
struct Ahead {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per_group = 0;

  // bytes [from, from + bytes) over `groups` steps
  Ahead(const void* from, int64_t bytes, int64_t groups)
      : p(static_cast<const char*>(from)), end(p + bytes), per_group((bytes / 64 + groups - 1) / groups) {}
  Ahead() = default;
  void step() {
    for (int64_t i = 0; i < per_group && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

// Two output blocks at once (dequantized into w0 and w1 on the first pass, wb0/wb1 non-null) times NT
// (1 or 2) row tiles: each A tile loaded feeds both blocks, each B tile both row tiles, four
// accumulators (0-1 block 0, 2-3 block 1), float32 into c [2][NT*16][16].
template <int Bits, int NT, typename S>
void multiply_pair(const uint16_t* const* a, int64_t K, int64_t G, uint32_t* w0, uint32_t* w1, float* c,
                   const uint8_t* wb0, const uint8_t* wb1, const S* d0, const S* d1, const S* mn0, const S* mn1,
                   Ahead* ahead = nullptr, Ahead* ahead2 = nullptr) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NT > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int64_t stride = K * 2;
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (Bits != kDense) {
      if (wb0) {
        dequantize_group<Bits>(wb0 + g * Bits * 64, d0 + g * kLanes, mn0 ? mn0 + g * kLanes : nullptr, w0 + g * 256);
        dequantize_group<Bits>(wb1 + g * Bits * 64, d1 + g * kLanes, mn1 ? mn1 + g * kLanes : nullptr, w1 + g * 256);
      }
    }
    if (ahead) ahead->step();
    if (ahead2) ahead2->step();
    _tile_loadd(6, w0 + g * 256, 64);
    _tile_loadd(7, w1 + g * 256, 64);
    _tile_loadd(4, a[0] + g * kGroup, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if constexpr (NT > 1) {
      _tile_loadd(5, a[1] + g * kGroup, stride);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(2, c + NT * 256, 64);
  if constexpr (NT > 1) {
    _tile_stored(1, c + 256, 64);
    _tile_stored(3, c + NT * 256 + 256, 64);
  }
}

template <typename T>
inline void store16(const float* c, T* out) {
  if constexpr (std::is_same_v<T, float>)
    _mm512_storeu_ps(out, _mm512_load_ps(c));
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(c))));
}

// silu(gate) * up into 16 bfloat16 outputs from a pair's float32 sums: each rounded to bfloat16 first, as
// the gate/up linear's output holds them, then silu_and_mul's arithmetic, so the bits are those of the two
// ops in turn.
inline void store_silu16(const float* gate, const float* up, c10::BFloat16* out) {
  auto rounded = [](const float* p) {
    const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  };
  const __m512 v = silu_mul(rounded(gate), rounded(up));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// x's whole row tiles are read in place, the last partial one from `tail` (16 rows, zero-padded).
// Silu: the weight is a gate projection's blocks then an up projection's (blocks / 2 each), and out [M,
// blocks / 2 * 16] (bfloat16) gets silu(gate) * up: gate block j and up block j go as one pair, whatever
// the row count, and are combined as they are stored.
template <int Bits, bool Silu = false, typename S, typename T>
void run(const uint16_t* x, const uint16_t* tail, int64_t M, int64_t K, const uint8_t* wp, const S* d, const S* mn,
         int64_t blocks, T* out) {
  const int64_t G = K / kGroup, padded = (M + 15) / 16 * 16, whole = M / 16 * 16;
  const int64_t half = blocks / 2, units = Silu ? half : blocks, N = units * kLanes;  // N: out's columns
  auto rows_at = [&](int64_t m) { return m < whole ? x + m * K : tail; };
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units)));
#pragma omp parallel num_threads(threads)
  {
    amx::configure_tiles();
    uint32_t* w = thread_scratch<0, uint32_t>(G * 256);  // the block's dequantized B tiles
    uint32_t* w1 = thread_scratch<2, uint32_t>(G * 256);  // a second block's, for pairs
    alignas(64) float c[kTiles * 16 * kLanes];
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t b0 = units * t / n, b1 = units * (t + 1) / n;
    const bool pairs = padded >= kPairRows;
    // block b's packed weights, scales and mins (none: Q8_0's -128 d)
    auto weights_at = [&](int64_t b) { return wp + b * G * Bits * 64; };
    auto d_at = [&](int64_t b) { return d + b * G * kLanes; };
    auto mn_at = [&](int64_t b) { return mn ? mn + b * G * kLanes : nullptr; };
    auto prefetch = [&](int64_t b, int64_t count) {  // blocks b..b + count - 1, contiguous
      prefetch_block(weights_at(b), d_at(b), mn_at(b), count * G * Bits * 64,
                     count * G * kLanes * static_cast<int64_t>(sizeof(S)));
    };
    // rows [r0, r1) times blocks b and p together, 32 rows a pass (dequantized on the first); store(row,
    // its 16 sums of block b, of block p) takes each row's results
    auto pair_passes = [&](int64_t r0, int64_t r1, int64_t b, int64_t p, auto&& store) {
      for (int64_t m0 = r0; m0 < r1; m0 += 32) {
        const int64_t nt = std::min<int64_t>(2, (r1 - m0) / 16);
        const bool first = m0 == r0;
        const uint8_t* wb0 = first ? weights_at(b) : nullptr;
        const uint8_t* wb1 = first ? weights_at(p) : nullptr;
        const uint16_t* a[2] = {rows_at(m0), rows_at(m0 + 16)};
        if (nt == 2)
          multiply_pair<Bits, 2>(a, K, G, w, w1, c, wb0, wb1, d_at(b), d_at(p), mn_at(b), mn_at(p));
        else
          multiply_pair<Bits, 1>(a, K, G, w, w1, c, wb0, wb1, d_at(b), d_at(p), mn_at(b), mn_at(p));
        const int64_t rows = std::min(M - m0, nt * 16);
        for (int64_t r = 0; r < rows; ++r) store(m0 + r, c + r * kLanes, c + nt * 256 + r * kLanes);
      }
    };
    for (int64_t r0 = 0; r0 < padded; r0 += kRowChunk) {
      const int64_t r1 = std::min(padded, r0 + kRowChunk);
      if constexpr (Silu) {
        for (int64_t j = b0; j < b1; ++j) {  // gate block j and up block half + j
          if (j + 1 < b1) {
            prefetch(j + 1, 1);
            prefetch(half + j + 1, 1);
          }
          pair_passes(r0, r1, j, half + j, [&](int64_t m, const float* gate, const float* up) {
            store_silu16(gate, up, out + m * N + j * kLanes);
          });
        }
        continue;
      }
      for (int64_t b = b0; b < b1; ++b) {
        if (pairs && b + 1 < b1) {  // blocks b and b + 1 together
          if (b + 2 < b1) prefetch(b + 2, std::min<int64_t>(2, b1 - b - 2));
          pair_passes(r0, r1, b, b + 1, [&](int64_t m, const float* c0, const float* c1) {
            store16(c0, out + m * N + b * kLanes);
            store16(c1, out + m * N + (b + 1) * kLanes);
          });
          ++b;
          continue;
        }
        if (b + 1 < b1) prefetch(b + 1, 1);
        for (int64_t m0 = r0; m0 < r1; m0 += kTiles * 16) {
          const int64_t nt = std::min<int64_t>(kTiles, (r1 - m0) / 16);
          const uint16_t* xm[4] = {rows_at(m0), rows_at(m0 + 16), rows_at(m0 + 32), rows_at(m0 + 48)};
          const uint8_t* wb = m0 == r0 ? weights_at(b) : nullptr;
          const S* db = d_at(b);
          const S* mb = mn_at(b);
          switch (nt) {
            case 1: multiply_block<Bits, 1>(xm, K, G, w, c, wb, db, mb); break;
            case 2: multiply_block<Bits, 2>(xm, K, G, w, c, wb, db, mb); break;
            case 3: multiply_block<Bits, 3>(xm, K, G, w, c, wb, db, mb); break;
            default: multiply_block<Bits, 4>(xm, K, G, w, c, wb, db, mb); break;
          }
          const int64_t rows = std::min(M - m0, nt * 16);
          for (int64_t r = 0; r < rows; ++r) store16(c + r * kLanes, out + (m0 + r) * N + b * kLanes);
        }
      }
    }
    _tile_release();
  }
}

// Dense bfloat16 weights prepacked in the tile unit's pair-row layout (kernels.reference.pack_tiles:
// [blocks][G][16 pair rows][16 lanes] dwords): nothing to dequantize, so every call runs multiply_pair
// (two output blocks at a time times two 16-row tiles of the input) over chunks of rows whose bfloat16 values fill
// at most kDenseChunkBytes (they stay in L2 while each pair's B tiles, from L1, pass over them). Chunks
// that large read the weights from memory once per chunk: in real steps (SmolLM2, 30 layers, weights
// from DRAM) 64 decode rows took 15.7 ms of matmuls and 64 + a 150-token chunk 35.4 ms, against
// 16.9/39.4 ms with 64-row chunks (and oneDNN's prepacked 21.1/37.7); hot in cache the two were level.
constexpr int64_t kDenseChunkBytes = 1536 * 1024;

// x's whole row tiles are read in place, its last partial one from `tail` (padded_tail). Silu: as run's.
template <bool Silu = false, typename T>
void run_dense(const uint16_t* x, const uint16_t* tail, int64_t M, int64_t K, const uint32_t* wp, int64_t blocks,
               T* out) {
  const int64_t G = K / kGroup, padded = (M + 15) / 16 * 16, whole = M / 16 * 16;
  const int64_t half = blocks / 2, N = (Silu ? half : blocks) * kLanes;
  const int64_t chunk = std::max<int64_t>(32, kDenseChunkBytes / (2 * K) / 32 * 32);
  auto rows_at = [&](int64_t m) { return m < whole ? x + m * K : tail; };
  const float* none = nullptr;
  // pairs: an odd block count leaves one thread a single block, multiplied with itself as its pair
  const int64_t pairs = Silu ? half : (blocks + 1) / 2;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs)));
#pragma omp parallel num_threads(threads)
  {
    amx::configure_tiles();
    alignas(64) float c[kTiles * 16 * kLanes];
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t p0 = pairs * t / n, p1 = pairs * (t + 1) / n;
    for (int64_t r0 = 0; r0 < padded; r0 += chunk) {
      const int64_t r1 = std::min(padded, r0 + chunk);
      const int64_t passes = (r1 - r0 + 31) / 32;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = Silu ? p : 2 * p, b1 = Silu ? half + p : std::min(b + 1, blocks - 1);
        // the next pair's weights, over this pair's products
        Ahead ahead, ahead2;
        if (p + 1 < p1) {
          if constexpr (Silu) {
            ahead = Ahead(wp + (p + 1) * G * 256, G * 1024, passes * G);
            ahead2 = Ahead(wp + (half + p + 1) * G * 256, G * 1024, passes * G);
          } else {
            ahead = Ahead(wp + 2 * (p + 1) * G * 256, std::min<int64_t>(2, blocks - 2 * (p + 1)) * G * 1024,
                          passes * G);
          }
        }
        for (int64_t m0 = r0; m0 < r1; m0 += 32) {
          const int64_t nt = std::min<int64_t>(2, (r1 - m0) / 16);
          const uint16_t* a[2] = {rows_at(m0), rows_at(m0 + 16)};
          uint32_t* w0 = const_cast<uint32_t*>(wp + b * G * 256);  // read only: nothing to dequantize
          uint32_t* w1 = const_cast<uint32_t*>(wp + b1 * G * 256);
          if (nt == 2)
            multiply_pair<kDense, 2>(a, K, G, w0, w1, c, nullptr, nullptr, none, none, none, none, &ahead, &ahead2);
          else
            multiply_pair<kDense, 1>(a, K, G, w0, w1, c, nullptr, nullptr, none, none, none, none, &ahead, &ahead2);
          const int64_t rows = std::min(M - m0, nt * 16);
          if constexpr (Silu) {
            for (int64_t r = 0; r < rows; ++r)
              store_silu16(c + r * kLanes, c + nt * 256 + r * kLanes, out + (m0 + r) * N + p * kLanes);
            continue;
          }
          for (int64_t r = 0; r < rows; ++r) {
            store16(c + r * kLanes, out + (m0 + r) * N + b * kLanes);
            if (b1 != b) store16(c + nt * 256 + r * kLanes, out + (m0 + r) * N + b1 * kLanes);
          }
        }
      }
    }
    _tile_release();
  }
}

}  // namespace
#endif

bool q4_amx_applies(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 && q4_linear_tiles_rows() > 0;
}

int64_t q4_linear_tiles_rows() {
#ifdef PAGEDSERVE_AMX
  return amx_attention_available() ? kQ4AmxMinRows : 0;
#else
  return 0;
#endif
}

#ifdef PAGEDSERVE_AMX
namespace {
template <int Bits, bool Silu = false>
void coded_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                      const at::Tensor& mn) {
  const int64_t M = x.size(0), K = x.size(1), blocks = d.size(0);
  const auto* xr = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* tail = padded_tail(xr, M, K);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto go = [&](const auto* dp, const auto* mp) {
    if constexpr (Silu)
      run<Bits, true>(xr, tail, M, K, wp, dp, mp, blocks, out.data_ptr<c10::BFloat16>());
    else if (out.scalar_type() == at::kFloat)
      run<Bits>(xr, tail, M, K, wp, dp, mp, blocks, out.data_ptr<float>());
    else
      run<Bits>(xr, tail, M, K, wp, dp, mp, blocks, out.data_ptr<c10::BFloat16>());
  };
  const bool no_m = mn.numel() == 0;
  if (d.scalar_type() == at::kHalf)
    go(d.data_ptr<c10::Half>(), no_m ? nullptr : mn.data_ptr<c10::Half>());
  else
    go(d.data_ptr<float>(), no_m ? nullptr : mn.data_ptr<float>());
}
}  // namespace
#endif

void q4_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                   const at::Tensor& mn) {
#ifdef PAGEDSERVE_AMX
  coded_linear_amx<4>(out, x, packed, d, mn);
#endif
}

void q4_gate_up_silu_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                         const at::Tensor& mn) {
#ifdef PAGEDSERVE_AMX
  coded_linear_amx<4, true>(out, x, packed, d, mn);
#endif
}

void q8_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                   const at::Tensor& mn) {
#ifdef PAGEDSERVE_AMX
  coded_linear_amx<8>(out, x, packed, d, mn);
#endif
}

// out [M, N] (bfloat16 or float32) = x [M, K] bfloat16 @ w.T, w prepacked by kernels.reference.pack_tiles.
void bf16_linear_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "bf16_linear_tiles: x");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 16 &&
                  packed.is_contiguous(),
              "bf16_linear_tiles: packed must be pack_tiles' int32 [N/16, K/32, 16, 16]");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 32 == K, "bf16_linear_tiles: x has ", K, " columns, the weight ", packed.size(1) * 32);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == blocks * 16 && out.is_contiguous() &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "bf16_linear_tiles: out must be a contiguous bfloat16 or float32 [rows, N]");
#ifdef PAGEDSERVE_AMX
  TORCH_CHECK(amx_attention_available(), "bf16_linear_tiles: no AMX tiles here");
  if (M == 0) return;
  const auto* xr = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* tail = padded_tail(xr, M, K);
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  if (out.scalar_type() == at::kFloat)
    run_dense(xr, tail, M, K, wp, blocks, out.data_ptr<float>());
  else
    run_dense(xr, tail, M, K, wp, blocks, out.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "bf16_linear_tiles: this build has no AMX tiles");
#endif
}

// out [M, N / 2] bfloat16 = silu(x @ gate.T) * (x @ up.T), the prepacked weight's blocks the gate's then the
// up's: bf16_linear_tiles then silu_and_mul in one pass, to the same bits.
void bf16_gate_up_silu_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "bf16_gate_up_silu_tiles: x");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 16 &&
                  packed.is_contiguous() && packed.size(0) % 2 == 0,
              "bf16_gate_up_silu_tiles: packed must be pack_tiles' int32 [N/16, K/32, 16, 16], N/16 even");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 32 == K, "bf16_gate_up_silu_tiles: x has ", K, " columns, the weight ",
              packed.size(1) * 32);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == blocks * 8 && out.is_contiguous() &&
                  out.scalar_type() == at::kBFloat16,
              "bf16_gate_up_silu_tiles: out must be a contiguous bfloat16 [rows, N / 2]");
#ifdef PAGEDSERVE_AMX
  TORCH_CHECK(amx_attention_available(), "bf16_gate_up_silu_tiles: no AMX tiles here");
  if (M == 0) return;
  const auto* xr = reinterpret_cast<const uint16_t*>(x.data_ptr());
  run_dense<true>(xr, padded_tail(xr, M, K), M, K, reinterpret_cast<const uint32_t*>(packed.data_ptr()), blocks,
                  out.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "bf16_gate_up_silu_tiles: this build has no AMX tiles");
#endif
}

}  // namespace pagedserve
