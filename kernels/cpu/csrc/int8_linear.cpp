// Weight-only int8 linear with one scale per group of 32 weights along the input (GGUF's
// Q8_0: w[n, k] = scale[n, k / 32] * q[n, k]), for steps of few rows.
//
// A step of a few tokens reads every weight once and does little arithmetic with it, so
// its time is the bytes read: int8 weights read half of bfloat16's, a quarter of
// float32's. torch's own int8 kernel keeps one scale per output row, which cannot hold a
// Q8_0 tensor exactly; this one does, so a head stored as Q8_0 (SmolLM2's tied
// embedding) runs from its own values. Rows of output are split over torch's OpenMP
// threads; each weight group is widened to float32 and scaled once, then multiplied into
// every input row, with per-lane accumulators reduced once per output.
#include "common.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace pagedserve {
namespace {

constexpr int64_t kGroup = 32;

// out[r, n] for R input rows (a compile-time count, so the accumulators stay in registers).
template <int R, typename T>
inline void rows_dot(T* out, const float* x, const int8_t* qn, const float* sn, int64_t groups, int64_t N,
                     int64_t K, int64_t n) {
  float acc[R][kGroup];
  for (int r = 0; r < R; ++r) std::fill_n(acc[r], kGroup, 0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    float w[kGroup];
    const float s = sn[g];
    const int8_t* qg = qn + g * kGroup;
#pragma omp simd
    for (int64_t k = 0; k < kGroup; ++k) w[k] = static_cast<float>(qg[k]) * s;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + g * kGroup;
#pragma omp simd
      for (int64_t k = 0; k < kGroup; ++k) acc[r][k] += xr[k] * w[k];
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < kGroup; ++k) sum += acc[r][k];
    store_row(&sum, out + r * N + n, 1);
  }
}

template <typename T>
void int8_linear_impl(T* out, const float* x, const int8_t* q, const float* scales, int64_t M, int64_t N,
                      int64_t K) {
  const int64_t groups = K / kGroup;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 64)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* qn = q + n * K;
    const float* sn = scales + n * groups;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows_dot<4>(out + m * N, x + m * K, qn, sn, groups, N, K, n);
    for (; m + 2 <= M; m += 2) rows_dot<2>(out + m * N, x + m * K, qn, sn, groups, N, K, n);
    for (; m < M; ++m) rows_dot<1>(out + m * N, x + m * K, qn, sn, groups, N, K, n);
  }
}

}  // namespace

void int8_group_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && scales.dim() == 2, "int8_group_linear: 2-D tensors");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(1) == K && qweight.is_contiguous(),
              "int8_group_linear: qweight must be int8 [N, K], contiguous");
  TORCH_CHECK(K % kGroup == 0, "int8_group_linear: K must be a multiple of ", kGroup);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.size(0) == N && scales.size(1) == K / kGroup &&
                  scales.is_contiguous(),
              "int8_group_linear: scales must be float32 [N, K / 32], contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.size(0) == M && out.size(1) == N && out.is_contiguous(),
              "int8_group_linear: out must be [M, N] in x's dtype, contiguous");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  dispatch_float_types(x.scalar_type(), "int8_group_linear", [&](auto tag) {
    using scalar_t = decltype(tag);
    int8_linear_impl(out.data_ptr<scalar_t>(), xf.data_ptr<float>(), qweight.data_ptr<int8_t>(),
                     scales.data_ptr<float>(), M, N, K);
  });
}

}  // namespace pagedserve
