// The few SIMD operations the attention kernel needs, over AVX-512 or AVX2 (+FMA, F16C),
// whichever this build's -march=native has; kHaveVec is false elsewhere and callers take
// their portable path. Loads widen bfloat16 (a shift) and float16 (F16C) to float32.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace pagedserve::vec {

#if defined(__AVX512F__)
constexpr bool kHaveVec = true;
constexpr int kWidth = 16;
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(V a) { return _mm512_reduce_add_ps(a); }
// out[i] = the sum of ai's lanes, i = 0..3
inline void reduce_add4(V a0, V a1, V a2, V a3, float* out) {
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V min(V a, V b) { return _mm512_min_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for integer-valued n in [-126, 127]
inline V pow2i(V n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// x rounded to bfloat16's precision (nearest even) and read back as float32; NaN not kept
inline V round_bf16(V a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHaveVec = true;
constexpr int kWidth = 8;
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
// ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): the order reduce_add4 sums each of its vectors in, so
// that a score is the same bits whichever of the two the attention kernel takes for its key (that depends
// on where the chunk ends: a prompt split into other chunks would otherwise get other scores)
inline float reduce_add(V a) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, a), a);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
inline void reduce_add4(V a0, V a1, V a2, V a3, float* out) {
  // pairwise sums within each 128-bit half, twice, then the two halves added: 3 hadds for 4 sums
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V min(V a, V b) { return _mm256_min_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V floor(V a) { return _mm256_floor_ps(a); }
inline V pow2i(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V round_bf16(V a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#else
constexpr bool kHaveVec = false;
constexpr int kWidth = 1;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
// exp(x) to about 1 ulp, x clamped to [-87, 88]: Cephes' expf, kWidth lanes at a time. x = n ln2 + r
// with n an integer and |r| <= ln2/2 (ln2 split in two so n ln2 is exact), exp(r) a degree-7 polynomial.
inline V exp(V x) {
  x = min(max(x, set1(-87.0f)), set1(88.0f));
  const V n = floor(fmadd(x, set1(1.44269504088896341f), set1(0.5f)));
  V r = fmadd(n, set1(-0.693359375f), x);
  r = fmadd(n, set1(2.12194440e-4f), r);
  V p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(mul(p, r), r, add(r, set1(1.0f)));
  return mul(p, pow2i(n));
}
#endif

}  // namespace pagedserve::vec
