// Stacked LoRA deltas of one projection for rows under several adapters at once
// (kernels/lora_stacked.py): out[i] += B_s (A_s x[i]), s the slot of row i, whose rank
// columns are [cols[i][0], cols[i][1]) of the stacked A [R, in] and B^T [R, out] (float32;
// an empty range: a base row). One call per projection where torch needs a shrink, a mask
// and an expand matmul, each costing tens of microseconds of dispatch at SmolLM2's shapes
// (16 rows, ranks in the tens), far more than its arithmetic; and each row multiplies only
// its own adapter's columns. Rows are split over torch's OpenMP threads; a row's delta is
// accumulated in float32 and added to out once.
#include "common.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace pagedserve {
namespace {

template <typename T>
void lora_stacked_impl(T* out, const T* x, const float* a, const float* bt, const int64_t* cols, int64_t M,
                       int64_t K, int64_t N) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> xf(K), acc(N), row(N);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      const int64_t c0 = cols[2 * i], c1 = cols[2 * i + 1];
      if (c0 >= c1) continue;
      load_row(x + i * K, xf.data(), K);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = c0; c < c1; ++c) {
        const float* ac = a + c * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < K; ++k) s += ac[k] * xf[k];
        const float* bc = bt + c * N;
        float* accp = acc.data();
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) accp[n] += s * bc[n];
      }
      load_row(out + i * N, row.data(), N);
      float* rowp = row.data();
      const float* accp = acc.data();
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) rowp[n] += accp[n];
      store_row(row.data(), out + i * N, N);
    }
  }
}

}  // namespace

void lora_stacked(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                  const at::Tensor& cols) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 2 && bt.dim() == 2, "lora_stacked: 2-d tensors");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && a.is_contiguous() && bt.is_contiguous() &&
                  cols.is_contiguous(), "lora_stacked: contiguous tensors");
  TORCH_CHECK(a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat, "lora_stacked: float32 A and B");
  TORCH_CHECK(cols.scalar_type() == at::kLong && cols.size(0) == x.size(0) && cols.size(1) == 2,
              "lora_stacked: cols [rows, 2] int64");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_stacked: x and out of one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M && a.size(1) == K && bt.size(1) == N && a.size(0) == bt.size(0),
              "lora_stacked: shapes");
  dispatch_float_types(x.scalar_type(), "lora_stacked", [&](auto tag) {
    using T = decltype(tag);
    lora_stacked_impl<T>(out.data_ptr<T>(), x.data_ptr<T>(), a.data_ptr<float>(), bt.data_ptr<float>(),
                         cols.data_ptr<int64_t>(), M, K, N);
  });
}

}  // namespace pagedserve
