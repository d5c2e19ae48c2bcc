// SiLU-and-mul on 16 float32 lanes with eager torch's bfloat16 roundings: silu_and_mul (fused_ops.cpp)
// and the gate/up tile kernels that apply it as they store (q4_amx.cpp) share it, so both give the
// same bits.
#pragma once

#include "vec.h"

namespace pagedserve {

#if defined(__AVX512F__)
// exp(-g) as 2^(-g log2 e): the product's rounding error (and the constant's) carried as a
// first-order correction, 2^fraction (vreduceps) by a degree-5 polynomial (relative error 8e-8),
// times 2^floor by vscalefps (0 far below, inf far above). About as accurate as vec::exp (about
// 1 ulp) in two thirds of its instructions, which bound the loop.
inline __m512 exp_neg(__m512 g) {
  const __m512 c = _mm512_set1_ps(-1.44269504088896341f);
  const __m512 x = _mm512_mul_ps(g, c);
  __m512 lo = _mm512_fmadd_ps(g, c, _mm512_sub_ps(_mm512_setzero_ps(), x));  // g c - x, exactly
  lo = _mm512_fmadd_ps(g, _mm512_set1_ps(-1.925963033500011e-08f), lo);       // -log2 e - c
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.0018774129171108581f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.008989194644940081f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05582702168750069f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24015310042303142f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931531897495181f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999999194721327f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(lo, _mm512_set1_ps(0.6931471805599453f)), p);  // 2^lo = 1 + lo ln 2
  return _mm512_scalef_ps(p, x);
}

// round(silu(g)) * u for gate and up values already bfloat16 (the caller rounds the product), silu =
// g / (1 + exp(-g)) divided exactly (a Newton reciprocal moved 1 in 10^4 outputs by a bfloat16 step)
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_neg(g));
  return _mm512_mul_ps(vec::round_bf16(_mm512_div_ps(g, d)), u);
}
#endif

}  // namespace pagedserve
