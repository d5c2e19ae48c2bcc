// Shared helpers of the CPU kernels: element conversion to and from float32, rows at a time.
//
// Kernels compute in float32 whatever the storage type. bfloat16 converts with bit
// shifts (and round-to-nearest-even on the way back, as torch does), written as plain
// loops the compiler vectorises. round_through<T> mimics a T-typed torch op: the float
// result rounded to T and read back, so fused kernels round where transformers' eager
// ops round.
#pragma once

// The tensor type and the thread count only, not <torch/extension.h>: that header (pybind11,
// autograd, torch::nn) made each kernel file take ~60 s to compile instead of ~10 s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedserve {

// One sequence's block table against its context and the pool (defence in depth behind
// BatchMetadata's checks): a bad table raises here instead of reading another sequence's KV
// or past the pool.
inline void check_block_table(const int64_t* table, int64_t table_len, int64_t ctx_len, int64_t block_size,
                              int64_t num_blocks, int64_t seq) {
  const int64_t used = (ctx_len + block_size - 1) / block_size;
  TORCH_CHECK(used <= table_len, "sequence ", seq, ": block table too short for its context (", ctx_len,
              " tokens need ", used, " blocks, the table has ", table_len, ")");
  for (int64_t b = 0; b < used; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "sequence ", seq, ": block id ", table[b], " at index ", b,
                " outside the KV pool of ", num_blocks, " blocks");
}

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 to about 2 ulp: 2^(x log2 e) split into an integer power and a
// degree-6 polynomial of the fraction; plain arithmetic, so loops of it vectorise.
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(s[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16_bits(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

template <typename T>
inline float round_through(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_bits_to_float(float_to_bf16_bits(x));
  } else {
    return static_cast<float>(static_cast<T>(x));
  }
}

// Calls f(T{}) with T the storage type of dtype: float, c10::BFloat16 or c10::Half.
template <typename F>
void dispatch_float_types(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, name, ": unsupported dtype ", dtype);
  }
}

}  // namespace pagedserve
