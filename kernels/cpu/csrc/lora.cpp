// LoRA deltas of one projection for rows under several adapters at once (kernels/lora_stacked.py):
// out[i] += B_s (A_s x[i]) for each row i under slot s. The slots' A sit side by side in a stacked
// A [R, in] and their B^T in B^T [R, out]; a step's rows come grouped by slot (`rows`: row indices,
// a group's rows together; `groups` [G, 4]: its rows [begin, end) in `rows` and its slot's columns
// [begin, end) of R). `blocks` [nb, 4] (c0, c1, n0, n1) says which outputs each column reaches: a
// fused projection's B is block-diagonal (q/k/v, gate/up), so column c only touches outputs
// [n0, n1) and the zeros are never read. One call per projection, where torch needs a shrink, a
// mask and an expand matmul (tens of microseconds of dispatch each at SmolLM2's shapes, far more
// than the arithmetic).
//
// Work items are tiles of up to kTile rows of one group: a tile reads its slot's A and B once for
// all its rows (register blocking), accumulates in float32 and adds to out once per element.
// Weights are float32 or bfloat16 (half the bytes; read by a shift), out and x float32, bfloat16
// or float16. Tiles go to torch's OpenMP threads when the call has enough work to pay for the fork
// (kParallelWork).
#include "common.h"
#include "vec.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace pagedserve {
namespace {

constexpr int kTile = 4;
// fused multiply-adds (as rows x columns x (in + out)) below which a call stays on the calling
// thread: a fork and join costs microseconds on a quiet host, but up to a scheduler quantum where
// other processes hold the other core (measured: ~20 ms per call on a 2-core host at load 14,
// against 4-80 us of arithmetic), as for every other OpenMP op of the step. 512K splits a 64-row
// SmolLM2 decode step's q/k/v, gate/up and down projections at rank 8 and a 16-row step's q/k/v and
// gate/up (quiet host, 4 adapters of rank 8 against the base model: C=64 0.80x -> 0.91x of its
// throughput, C=16 0.84x -> 0.83x, one run each; 4M kept them all on one thread).
constexpr int64_t kParallelWork = 1 << 19;

template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_bits_to_float(v.x);
  } else {
    return static_cast<float>(v);
  }
}

template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return c10::BFloat16(float_to_bf16_bits(f), c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(f);
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
template <typename T>
inline void add_store(T* p, vec::V acc) {
  if constexpr (std::is_same_v<T, float>) {
    vec::store(p, vec::add(vec::load(p), acc));
  } else {
    float tmp[vec::kWidth];
    vec::store(tmp, vec::add(vec::load(p), acc));
    store_row(tmp, p, vec::kWidth);
  }
}
#endif

struct Shape {
  int64_t K, N, x_stride, out_stride;
};

// s[i][c] = dot(A[c0 + c], xf[i]) for the tile's rows (xf: kTile float rows of K, zero past the tile)
template <typename W>
void shrink(const W* a, int64_t c0, int64_t c1, const float* xf, int64_t K, float* s) {
  const int64_t r = c1 - c0;
  for (int64_t c = 0; c < r; ++c) {
    const W* ac = a + (c0 + c) * K;
    float sums[kTile];
    int64_t k = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
    vec::V acc[kTile];
    for (int i = 0; i < kTile; ++i) acc[i] = vec::zero();
    for (; k + vec::kWidth <= K; k += vec::kWidth) {
      const vec::V va = vec::load(ac + k);
      for (int i = 0; i < kTile; ++i) acc[i] = vec::fmadd(va, vec::load(xf + i * K + k), acc[i]);
    }
    for (int i = 0; i < kTile; ++i) sums[i] = vec::reduce_add(acc[i]);
#else
    for (int i = 0; i < kTile; ++i) sums[i] = 0.0f;
#endif
    for (; k < K; ++k) {
      const float av = to_float(ac[k]);
      for (int i = 0; i < kTile; ++i) sums[i] += av * xf[i * K + k];
    }
    for (int i = 0; i < kTile; ++i) s[i * r + c] = sums[i];
  }
}

// out[row_i][n0:n1] += sum over c in [b0, b1) of s[i][c - c0] * B^T[c][n0:n1]
template <typename T, typename W>
void expand(const W* bt, int64_t b0, int64_t b1, int64_t n0, int64_t n1, int64_t c0, int64_t r, const float* s,
            T* const* out_rows, int nrows, int64_t N) {
  int64_t n = n0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
  for (; n + vec::kWidth <= n1; n += vec::kWidth) {
    vec::V acc[kTile];
    for (int i = 0; i < kTile; ++i) acc[i] = vec::zero();
    for (int64_t c = b0; c < b1; ++c) {
      const vec::V vb = vec::load(bt + c * N + n);
      for (int i = 0; i < kTile; ++i) acc[i] = vec::fmadd(vec::set1(s[i * r + (c - c0)]), vb, acc[i]);
    }
    for (int i = 0; i < nrows; ++i) add_store(out_rows[i] + n, acc[i]);
  }
#endif
  for (; n < n1; ++n) {
    for (int i = 0; i < nrows; ++i) {
      float acc = 0.0f;
      for (int64_t c = b0; c < b1; ++c) acc += s[i * r + (c - c0)] * to_float(bt[c * N + n]);
      out_rows[i][n] = from_float<T>(to_float(out_rows[i][n]) + acc);
    }
  }
}

template <typename T, typename W>
void tile(T* out, const T* x, const W* a, const W* bt, const int64_t* blocks, int64_t nb, const int64_t* rows,
          int nrows, int64_t c0, int64_t c1, const Shape& sh, std::vector<float>& xf, std::vector<float>& s) {
  const int64_t K = sh.K, r = c1 - c0;
  xf.assign(kTile * K, 0.0f);
  s.resize(kTile * r);
  T* out_rows[kTile];
  for (int i = 0; i < nrows; ++i) {
    load_row(x + rows[i] * sh.x_stride, xf.data() + i * K, K);
    out_rows[i] = out + rows[i] * sh.out_stride;
  }
  shrink(a, c0, c1, xf.data(), K, s.data());
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t* blk = blocks + 4 * b;
    const int64_t b0 = std::max(blk[0], c0), b1 = std::min(blk[1], c1);
    if (b0 < b1) expand(bt, b0, b1, blk[2], blk[3], c0, r, s.data(), out_rows, nrows, sh.N);
  }
}

template <typename T, typename W>
void lora_grouped_impl(T* out, const T* x, const W* a, const W* bt, const int64_t* blocks, int64_t nb,
                       const int64_t* rows, const int64_t* groups, int64_t G, const Shape& sh) {
  struct Item {
    int64_t first;  // in rows
    int nrows;
    int64_t c0, c1;
  };
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* grp = groups + 4 * g;
    if (grp[2] >= grp[3]) continue;
    for (int64_t i = grp[0]; i < grp[1]; i += kTile) {
      items.push_back({i, static_cast<int>(std::min<int64_t>(kTile, grp[1] - i)), grp[2], grp[3]});
    }
    work += (grp[1] - grp[0]) * (grp[3] - grp[2]) * (sh.K + sh.N);
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int threads = work < kParallelWork ? 1
                                           : static_cast<int>(std::max<int64_t>(
                                                 1, std::min<int64_t>(at::get_num_threads(), n_items)));
  if (threads == 1) {
    std::vector<float> xf, s;
    for (const Item& it : items) tile(out, x, a, bt, blocks, nb, rows + it.first, it.nrows, it.c0, it.c1, sh, xf, s);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> xf, s;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n_items; ++j) {
      const Item& it = items[j];
      tile(out, x, a, bt, blocks, nb, rows + it.first, it.nrows, it.c0, it.c1, sh, xf, s);
    }
  }
}

}  // namespace

void lora_grouped(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                  const at::Tensor& blocks, const at::Tensor& rows, const at::Tensor& groups) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 2 && bt.dim() == 2, "lora_grouped: 2-d tensors");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "lora_grouped: x and out with contiguous rows");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && blocks.is_contiguous() && rows.is_contiguous() &&
                  groups.is_contiguous(), "lora_grouped: contiguous A, B^T, blocks, rows and groups");
  TORCH_CHECK(a.scalar_type() == bt.scalar_type() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_grouped: A and B^T both float32 or both bfloat16");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.size(1) == 4,
              "lora_grouped: blocks [nb, 4] int64");
  TORCH_CHECK(groups.scalar_type() == at::kLong && groups.dim() == 2 && groups.size(1) == 4,
              "lora_grouped: groups [G, 4] int64");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "lora_grouped: rows [n] int64");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_grouped: x and out of one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), R = a.size(0);
  TORCH_CHECK(out.size(0) == M && a.size(1) == K && bt.size(1) == N && bt.size(0) == R, "lora_grouped: shapes");
  const int64_t* blk = blocks.data_ptr<int64_t>();
  for (int64_t b = 0; b < blocks.size(0); ++b) {
    TORCH_CHECK(0 <= blk[4 * b] && blk[4 * b] <= blk[4 * b + 1] && blk[4 * b + 1] <= R && 0 <= blk[4 * b + 2] &&
                    blk[4 * b + 2] <= blk[4 * b + 3] && blk[4 * b + 3] <= N, "lora_grouped: block out of range");
  }
  const int64_t* grp = groups.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups.size(0); ++g) {
    TORCH_CHECK(0 <= grp[4 * g] && grp[4 * g] <= grp[4 * g + 1] && grp[4 * g + 1] <= rows.size(0) &&
                    0 <= grp[4 * g + 2] && grp[4 * g + 2] <= grp[4 * g + 3] && grp[4 * g + 3] <= R,
                "lora_grouped: group out of range");
  }
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(0 <= row[i] && row[i] < M, "lora_grouped: row out of range");
  const Shape sh{K, N, x.stride(0), out.stride(0)};
  dispatch_float_types(x.scalar_type(), "lora_grouped", [&](auto tag) {
    using T = decltype(tag);
    if (a.scalar_type() == at::kFloat) {
      lora_grouped_impl<T, float>(out.data_ptr<T>(), x.data_ptr<T>(), a.data_ptr<float>(), bt.data_ptr<float>(), blk,
                                  blocks.size(0), row, grp, groups.size(0), sh);
    } else {
      lora_grouped_impl<T, c10::BFloat16>(out.data_ptr<T>(), x.data_ptr<T>(), a.data_ptr<c10::BFloat16>(),
                                          bt.data_ptr<c10::BFloat16>(), blk, blocks.size(0), row, grp,
                                          groups.size(0), sh);
    }
  });
}

}  // namespace pagedserve
