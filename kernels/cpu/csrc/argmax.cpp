// Greedy sampling's argmax over float32 logit rows, rows on OpenMP threads: the first index of each
// row's maximum, and of its first NaN where it has one (numpy's argmax, which the sampler used:
// ~1.1 ms for 64 rows of a 49k vocabulary on one thread of the AMX Xeon).
#include "common.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedserve {
namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  float best = x[0];
  int64_t at = 0, i = 1;
  bool nan = std::isnan(best);
#if defined(__AVX512F__)
  if (n >= 16) {
    // per lane the first of its maxima (strictly greater replaces), then the smallest index among
    // the lanes holding the row's maximum
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 bv = _mm512_loadu_ps(x);
    __m512i bi = idx;
    __mmask16 unordered = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
      bv = _mm512_mask_mov_ps(bv, gt, v);
      bi = _mm512_mask_mov_epi32(bi, gt, idx);
    }
    if (unordered) return first_nan(x, n);
    best = _mm512_reduce_max_ps(bv);
    at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ), bi);
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    nan |= std::isnan(v);
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return nan ? first_nan(x, n) : at;
}

}  // namespace

// out[r] = the first index of row r's maximum (of its first NaN, if any): numpy's argmax(axis=-1).
void argmax_rows(at::Tensor& out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0, "argmax_rows: logits must be float32 [rows, vocab > 0], contiguous");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == logits.size(0) &&
                  out.is_contiguous(), "argmax_rows: out must be int64 [rows]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(x + r * n, n);
}

}  // namespace pagedserve
