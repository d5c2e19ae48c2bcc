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
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, V a) { _mm512_storeu_ps(p, a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHaveVec = true;
constexpr int kWidth = 8;
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, V a) { _mm256_storeu_ps(p, a); }
#else
constexpr bool kHaveVec = false;
constexpr int kWidth = 1;
#endif

}  // namespace pagedserve::vec
