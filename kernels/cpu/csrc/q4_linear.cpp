// Weight-only 4-bit linear (GGUF's Q4_1: w[n, k] = d[n, g] * c[n, k] + m[n, g], codes 0..15, one
// (d, m) per group g of 32 inputs) whose every weight is unpacked once per call, whatever the
// number of input rows.
//
// torch's `_weight_int4pack_mm_for_cpu` unpacks the weights again for each row, so its time grows
// with the rows (on one host 5.6 ms per row for SmolLM2's decoder); a step of a few tokens should
// cost what reading 4-bit weights costs. Here the input rows are quantized per group of 32 to
// int8 (x ~ dx * cx, as llama.cpp's Q8 activations), and each group's dot product is an integer
// one: sum_k c[n, k] * cx[k], u8 x s8, 4 products per 32-bit lane (AVX-512 VNNI `dpbusd`, or
// AVX2 `maddubs`), scaled once per group:
//     y[n] = sum_g d[n, g] * dx[g] * (c . cx)[n, g] + m[n, g] * dx[g] * sum(cx over g).
// Weights are packed 16 output rows at a time so that one 32-bit lane holds 4 inputs of one row:
// packed[block][g][h][lane][byte], h = 0..3, with the low nibble the code of input
// g*32 + h*4 + byte and the high nibble that of input g*32 + (h+4)*4 + byte; d and m as
// [block][g][lane] float32 or float16. `kernels/reference.py` has the same computation in plain torch.
#include "common.h"
#include "q4_amx.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

namespace pagedserve {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kLanes = 16;   // output rows per packed block
// Calls of at most kFetchRows rows read their weights from DRAM about as fast as they compute
// them: each block's first row tile prefetches the weights kAhead bytes on (a 576-input block is
// 4.6 KB at 4 bits). Zen 4, 30 SmolLM2 decoder layers (benchmarks.quantized_linear_dram, alternated
// builds): 1/4/8/16/32/64 rows 0.95/0.84/0.82/0.90/0.93/0.96x the time; the head at 16 and 32 rows
// 0.76-0.91x, at 64 1.0x. Past 64 it hurt: 128 and 214 rows 1.25x and 1.12x, as the row tiles between
// push the fetched lines out of L1 before they are used.
constexpr int64_t kAhead = 4096;
constexpr int64_t kFetchRows = 64;
constexpr int64_t kRowTile = 16;  // input rows handed to block_rows at a time (its register tiles may be smaller)
constexpr int64_t kChunkBytes = 128 * 1024;  // int8 input rows a thread walks its weights with at a time

// The Bits cache lines of the group kAhead bytes on (a group is Bits * 64 bytes).
template <int Bits>
inline void fetch_ahead(const uint8_t* wg) {
  for (int l = 0; l < Bits; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead + l * 64), _MM_HINT_T0);
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One group of 32 values -> int8 codes c (round to nearest even, as torch.round), its scale d
// (largest magnitude / 127) and d * the sum of its codes; with z_out, also -128 * that sum (the
// Q8_0 weights' offset, added to the integer dot products: `Rows::zs`).
inline void quantize_group(const float* buf, int8_t* c, float* d_out, float* s_out, int32_t* z_out) {
#if defined(__AVX2__)
  const __m256 v0 = _mm256_loadu_ps(buf), v1 = _mm256_loadu_ps(buf + 8);
  const __m256 v2 = _mm256_loadu_ps(buf + 16), v3 = _mm256_loadu_ps(buf + 24);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
  const float amax = _mm256_cvtss_f32(m);
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  // cvtps rounds to nearest even under the default rounding mode, as nearbyint does
  const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
  const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  // the packs interleave the two 128-bit halves: put the 4-byte groups back in order
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  const int32_t sum = _mm_cvtsi128_si32(h);
#else
  float amax = 0.0f;
  for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(buf[k]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(buf[k] * inv));
    c[k] = static_cast<int8_t>(q);
    sum += q;
  }
#endif
  const float d = amax / 127.0f;
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
  if (z_out != nullptr) *z_out = -128 * sum;
}

// x [M, K] -> int8 codes [M, K], dx [M, G] and dx * sum of codes [M, G] (and with zs, -128 * sum
// of codes [M, G]), per group of 32; rows in parallel where there are enough of them (a prefill
// chunk's rows took a serial tenth of the call).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* cx, float* dx, float* sx, int32_t* zs, int threads) {
  const int64_t G = K / kGroup;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M * K >= 16384)
  for (int64_t r = 0; r < M; ++r) {
    float buf[kGroup];
    for (int64_t g = 0; g < G; ++g) {
      const T* src = x + r * K + g * kGroup;
      const float* row = buf;
      if constexpr (std::is_same_v<T, float>) {
        row = src;
      } else {
        load_row(src, buf, kGroup);
      }
      quantize_group(row, cx + r * K + g * kGroup, dx + r * G + g, sx + r * G + g,
                     zs == nullptr ? nullptr : zs + r * G + g);
    }
  }
}

// The quantized input rows a call multiplies, from a row on: int8 codes [M, K] and per group of 32
// their scale dx, dx * the sum of their codes (sx) and, for Q8_0 weights, -128 * that sum (zs).
struct Rows {
  const int8_t* cx;
  const float* dx;
  const float* sx;
  const int32_t* zs;  // null unless the weights are Q8_0's (m = -128 d, see q8_linear)
  int64_t K, G;

  Rows from(int64_t r) const { return {cx + r * K, dx + r * G, sx + r * G, zs == nullptr ? nullptr : zs + r * G, K, G}; }
};

inline float scale_at(const float* p, int64_t i) { return p[i]; }
inline float scale_at(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }

// Each kernel below computes, for one packed block of 16 output rows and input rows x, all groups:
//   out[i] = sum_g d[g] * dx[i, g] * (c . cx)[i, g] + m[g] * sx[i, g]
// or, with Sym (Q8_0: m = -128 d), sum_g d[g] * dx[i, g] * ((c . cx)[i, g] + zs[i, g]): the offset
// is exact in the integer sum, and one float multiply-add a row and group fewer (the head's
// q8_linear at 64 and 150 rows 0.90-0.92x the time), and no m to read.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 float32 sums into out in its dtype (rounded as torch's .to() rounds)
template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    store_row(tmp, p, 16);
  }
}

// acc += w . (the 4 bytes at x, broadcast to every lane), the broadcast folded into dpbusd's memory
// operand: written as intrinsics the compiler emitted a separate vpbroadcastd per product, and the
// kernel ran 8-18% slower.
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* x) {
#if defined(__GNUC__)
  asm("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*reinterpret_cast<const int32_t*>(x)), "v"(w));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(load_i32(x)));
#endif
}

// R (a compile-time count) input rows, so that their accumulators stay in registers; each row's
// eight dot products of a group in two chains of four (a single chain waited on dpbusd's latency;
// from 4 rows on, one chain a row measured the same as two).
template <int Bits, int R, bool Sym, typename S, typename T>
void block_rows_fixed(const uint8_t* wp, const S* d, const S* mn, const Rows& x, T* out, int64_t ldo, bool fetch) {
  const int64_t K = x.K, G = x.G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wp + g * Bits * 64;
    if (fetch) fetch_ahead<Bits>(wg);
    __m512i w[8];
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      if constexpr (Bits == 8) {
        w[h] = _mm512_loadu_si512(wg + h * 64);
        w[h + 4] = _mm512_loadu_si512(wg + (h + 4) * 64);
      } else {
        const __m512i v = _mm512_loadu_si512(wg + h * 64);
        w[h] = _mm512_and_si512(v, low4);
        w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    const __m512 dv = load_scales(d + g * kLanes);
    __m512 mv = _mm512_setzero_ps();
    if constexpr (!Sym) mv = load_scales(mn + g * kLanes);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int8_t* xg = x.cx + i * K + g * kGroup;
      __m512i s0 = Sym ? _mm512_set1_epi32(x.zs[i * G + g]) : _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {
        s0 = dpbusd_bcast(s0, w[h], xg + h * 4);
        s1 = dpbusd_bcast(s1, w[h + 4], xg + (h + 4) * 4);
      }
      const __m512i s = _mm512_add_epi32(s0, s1);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(x.dx[i * G + g])), acc[i]);
      if constexpr (!Sym) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sx[i * G + g]), acc[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) store16(out + i * ldo, acc[i]);
}

// Up to 16 rows in one tile for 4-bit codes, whose nibbles each tile unpacks again (16 rows of
// SmolLM2's and the 1B shape's decoder 0.89-0.94x the time of two tiles of 8, bit-identical); 8
// for bytes, which load as they are (16 took the 1B shape's head 1.37x the time at 16 rows, 1.09x at 64).
template <int Bits, bool Sym, typename S, typename T>
void block_rows(const uint8_t* wp, const S* d, const S* mn, Rows x, int64_t rows, T* out, int64_t ldo, bool fetch) {
  if constexpr (Bits == 8) {
    if (rows > 8) {
      block_rows_fixed<Bits, 8, Sym>(wp, d, mn, x, out, ldo, fetch);
      x = x.from(8), out += 8 * ldo, rows -= 8, fetch = false;
    }
  }
  switch (rows) {
    case 1: return block_rows_fixed<Bits, 1, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 2: return block_rows_fixed<Bits, 2, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 3: return block_rows_fixed<Bits, 3, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 4: return block_rows_fixed<Bits, 4, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 5: return block_rows_fixed<Bits, 5, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 6: return block_rows_fixed<Bits, 6, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 7: return block_rows_fixed<Bits, 7, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 8: return block_rows_fixed<Bits, 8, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 9: return block_rows_fixed<Bits, 9, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 10: return block_rows_fixed<Bits, 10, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 11: return block_rows_fixed<Bits, 11, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 12: return block_rows_fixed<Bits, 12, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 13: return block_rows_fixed<Bits, 13, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 14: return block_rows_fixed<Bits, 14, Sym>(wp, d, mn, x, out, ldo, fetch);
    case 15: return block_rows_fixed<Bits, 15, Sym>(wp, d, mn, x, out, ldo, fetch);
    default: return block_rows_fixed<Bits, 16, Sym>(wp, d, mn, x, out, ldo, fetch);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R (a compile-time count) input rows, so that their accumulators stay in registers. 8-bit codes
// are split into their nibbles here: maddubs sums two u8 x s8 products in int16, which
// 255 * 127 * 2 overflows.
template <int Bits, int R, bool Sym, typename S, typename T>
void block_rows_fixed(const uint8_t* wp, const S* d, const S* mn, const Rows& x, T* out, int64_t ldo, bool fetch) {
  const int64_t K = x.K, G = x.G;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {  // lanes 0-7, then 8-15 of the 16-row block
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = wp + g * Bits * 64 + half * 32;
      if (fetch && half == 0) fetch_ahead<Bits>(wg);  // the second half reads the same lines
      // 4-bit: the codes of inputs h*4.. (h < 4: low nibbles, else high); 8-bit: their low nibbles,
      // and in hi their high ones
      __m256i w[8], hi[Bits == 8 ? 8 : 1];
      for (int h = 0; h < 4; ++h) {
        if constexpr (Bits == 8) {
          for (int j = 0; j < 2; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (h + 4 * j) * 64));
            w[h + 4 * j] = _mm256_and_si256(v, low4);
            hi[h + 4 * j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          }
        } else {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + h * 64));
          w[h] = _mm256_and_si256(v, low4);
          w[h + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      }
      const __m256 dv = load_scales(d + g * kLanes + half * 8);
      __m256 mv = _mm256_setzero_ps();
      if constexpr (!Sym) mv = load_scales(mn + g * kLanes + half * 8);
      for (int i = 0; i < R; ++i) {
        const int8_t* xg = x.cx + i * K + g * kGroup;
        // each maddubs pair sum is at most 2 * 15 * 127: eight of them still fit in int16
        __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load_i32(xg)));
        for (int h = 1; h < 8; ++h)
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[h], _mm256_set1_epi32(load_i32(xg + h * 4))));
        __m256i s = _mm256_madd_epi16(s16, ones);
        if constexpr (Bits == 8) {
          __m256i h16 = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(load_i32(xg)));
          for (int h = 1; h < 8; ++h)
            h16 = _mm256_add_epi16(h16, _mm256_maddubs_epi16(hi[h], _mm256_set1_epi32(load_i32(xg + h * 4))));
          s = _mm256_add_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(h16, ones), 4));
        }
        if constexpr (Sym) s = _mm256_add_epi32(s, _mm256_set1_epi32(x.zs[i * G + g]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_set1_ps(x.dx[i * G + g])), acc[i]);
        if constexpr (!Sym) acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sx[i * G + g]), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[i]);
      store_row(tmp, out + i * ldo + half * 8, 8);
    }
  }
}

// Tiles of 4 rows: with 8, the 16 AVX2 registers cannot hold the weights and accumulators and the
// compiler spills (single thread, SmolLM2 shapes: 4 rows per tile 5-23% faster than 8 at 1-64 rows).
template <int Bits, bool Sym, typename S, typename T>
void block_rows(const uint8_t* wp, const S* d, const S* mn, Rows x, int64_t rows, T* out, int64_t ldo, bool fetch) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4, fetch = false)
    block_rows_fixed<Bits, 4, Sym>(wp, d, mn, x.from(i), out + i * ldo, ldo, fetch);
  const Rows rest = x.from(i);
  T* o = out + i * ldo;
  switch (rows - i) {
    case 1: block_rows_fixed<Bits, 1, Sym>(wp, d, mn, rest, o, ldo, fetch); break;
    case 2: block_rows_fixed<Bits, 2, Sym>(wp, d, mn, rest, o, ldo, fetch); break;
    case 3: block_rows_fixed<Bits, 3, Sym>(wp, d, mn, rest, o, ldo, fetch); break;
    default: break;
  }
}
#else
template <int Bits, bool Sym, typename S, typename T>
void block_rows(const uint8_t* wp, const S* d, const S* mn, Rows x, int64_t rows, T* out, int64_t ldo, bool /*fetch*/) {
  const int64_t K = x.K, G = x.G;
  for (int64_t i = 0; i < rows; ++i) {
    float acc[kLanes] = {};
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = wp + g * Bits * 64;
      const int8_t* xg = x.cx + i * K + g * kGroup;
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        int32_t s = Sym ? x.zs[i * G + g] : 0;
        for (int h = 0; h < 4; ++h)
          for (int b = 0; b < 4; ++b) {
            if constexpr (Bits == 8) {
              s += wg[h * 64 + lane * 4 + b] * xg[h * 4 + b] + wg[(h + 4) * 64 + lane * 4 + b] * xg[(h + 4) * 4 + b];
            } else {
              const uint8_t byte = wg[h * 64 + lane * 4 + b];
              s += (byte & 0x0F) * xg[h * 4 + b] + (byte >> 4) * xg[(h + 4) * 4 + b];
            }
          }
        acc[lane] += static_cast<float>(s) * (scale_at(d, g * kLanes + lane) * x.dx[i * G + g]);
        if constexpr (!Sym) acc[lane] += scale_at(mn, g * kLanes + lane) * x.sx[i * G + g];
      }
    }
    store_row(acc, out + i * ldo, kLanes);
  }
}
#endif

// Sym: 8-bit codes of Q8_0 weights, whose m (-128 d) the caller leaves out (mn empty).
// tiles: by q4_amx.cpp's tile path instead of the integer one (bfloat16 x, AMX).
template <int Bits>
void coded_linear(const char* name, at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                  const at::Tensor& d, const at::Tensor& mn, bool tiles = false, bool silu = false) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be [M, K], contiguous");
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, name, ": K must be a multiple of ", kGroup);
  const bool sym = Bits == 8 && mn.numel() == 0;
  TORCH_CHECK(d.dim() == 3 && d.size(1) == G && d.size(2) == kLanes &&
                  (d.scalar_type() == at::kFloat || d.scalar_type() == at::kHalf) && d.is_contiguous() &&
                  (sym || (mn.sizes() == d.sizes() && mn.is_contiguous())) && mn.scalar_type() == d.scalar_type(),
              name, ": d and m must be float32 or float16 [N / 16, K / 32, 16], contiguous, of one dtype",
              Bits == 8 ? " (m may be empty: Q8_0's -128 d)" : "");
  const int64_t blocks = d.size(0), N = blocks * kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == N * K * Bits / 8,
              name, ": packed must be uint8 with N * K * ", Bits, " / 8 bytes, contiguous");
  if (silu) {
    TORCH_CHECK(blocks % 2 == 0 && out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == M &&
                    out.size(1) == N / 2 && out.is_contiguous(),
                name, ": out must be bfloat16 [M, N / 2], contiguous, N / 16 even");
    TORCH_CHECK(q4_amx_applies(x), name, ": needs bfloat16 rows and AMX tiles (q4_linear_tiles_rows)");
    if constexpr (Bits == 4) return q4_gate_up_silu_amx(out, x, packed, d, mn);
  }
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == x.scalar_type()) && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N && out.is_contiguous(),
              name, ": out must be float32 or x's dtype, [M, N], contiguous");
  if (tiles) {
    TORCH_CHECK(q4_amx_applies(x), name, ": needs bfloat16 rows and AMX tiles (q4_linear_tiles_rows)");
    if constexpr (Bits == 8)
      return q8_linear_amx(out, x, packed, d, mn);
    else
      return q4_linear_amx(out, x, packed, d, mn);
  }
  // uninitialised: every byte is written before it is read
  std::unique_ptr<int8_t[]> cx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * G]), sx(new float[M * G]);
  std::unique_ptr<int32_t[]> zs(sym ? new int32_t[M * G] : nullptr);
  dispatch_float_types(x.scalar_type(), name, [&](auto tag) {
    using scalar_t = decltype(tag);
    quantize_rows(x.data_ptr<scalar_t>(), M, K, cx.get(), dx.get(), sx.get(), zs.get(), at::get_num_threads());
  });
  const Rows rows_all{cx.get(), dx.get(), sx.get(), zs.get(), K, G};
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / 4)));
  // Each thread takes a range of blocks and walks it once per chunk of rows, the chunk's int8 rows
  // (at most kChunkBytes) staying in L2 beside the range's weights; one pass over all rows
  // streamed a long prompt's rows through L2 once per block.
  const int64_t chunk = std::max<int64_t>(kRowTile, kChunkBytes / K / kRowTile * kRowTile);
  const bool fetch = M <= kFetchRows;
  auto run = [&](auto sym_tag, const auto* dp, const auto* mp, auto* op) {
    constexpr bool kSym = decltype(sym_tag)::value;
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      const int64_t b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
      for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t c1 = std::min(M, c0 + chunk);
        for (int64_t b = b0; b < b1; ++b) {
          for (int64_t m0 = c0; m0 < c1; m0 += kRowTile) {
            const int64_t rows = std::min(kRowTile, c1 - m0);
            block_rows<Bits, kSym>(wp + b * G * Bits * 64, dp + b * G * kLanes, kSym ? mp : mp + b * G * kLanes,
                                   rows_all.from(m0), rows, op + m0 * N + b * kLanes, N, fetch && m0 == c0);
          }
        }
      }
    }
  };
  auto with_out = [&](const auto* dp, const auto* mp) {
    auto go = [&](auto* op) {
      if constexpr (Bits == 8) {
        if (sym) return run(std::true_type{}, dp, mp, op);
      }
      run(std::false_type{}, dp, mp, op);
    };
    if (out.scalar_type() == at::kFloat) return go(out.data_ptr<float>());
    dispatch_float_types(out.scalar_type(), name, [&](auto tag) {
      using out_t = decltype(tag);
      go(out.data_ptr<out_t>());
    });
  };
  // float16 scales (GGUF's own precision) read a third fewer bytes than float32 ones
  if (d.scalar_type() == at::kHalf)
    with_out(d.data_ptr<c10::Half>(), mn.data_ptr<c10::Half>());
  else
    with_out(d.data_ptr<float>(), mn.data_ptr<float>());
}

}  // namespace

// out [M, N] (float32, or x's dtype) = x [M, K] @ w.T for the packed Q4_1 weight w [N, K], N a
// multiple of 16.
void q4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
               const at::Tensor& mn) {
  coded_linear<4>("q4_linear", out, x, packed, d, mn);
}

// q4_linear on AMX tiles (q4_amx.cpp): bfloat16 x, weights dequantized to bfloat16 once per call, so
// its results are the dense bfloat16 weights' rather than int8-quantized rows'.
void q4_linear_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                     const at::Tensor& mn) {
  coded_linear<4>("q4_linear_tiles", out, x, packed, d, mn, true);
}

// q4_linear_tiles of a gate/up weight (the gate's rows, then the up's) followed by silu_and_mul, in one
// pass: out [M, N / 2] bfloat16, the same bits as the two ops.
void q4_gate_up_silu_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                           const at::Tensor& mn) {
  coded_linear<4>("q4_gate_up_silu_tiles", out, x, packed, d, mn, true, true);
}

// The same for 8-bit codes 0..255 (kernels/reference.py's q8_pack): GGUF's Q8_0 (w = s * c, c in
// -127..127) is d = s, m = -128 s on the codes c + 128; an empty mn says so, and the kernel then adds
// -128 * the sum of each group's input codes to its integer dot product instead of a float m term.
void q8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
               const at::Tensor& mn) {
  coded_linear<8>("q8_linear", out, x, packed, d, mn);
}

// q8_linear on AMX tiles (q4_amx.cpp), as q4_linear_tiles: the dense bfloat16 weights' results.
void q8_linear_tiles(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                     const at::Tensor& mn) {
  coded_linear<8>("q8_linear_tiles", out, x, packed, d, mn, true);
}

}  // namespace pagedserve
