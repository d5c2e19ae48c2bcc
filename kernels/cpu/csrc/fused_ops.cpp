// Fused elementwise ops of a Llama decoder layer on the CPU, one pass over memory each:
// RMSNorm (optionally with the residual add first), SiLU-and-mul, and RoPE on q/k
// with k and v written to their cache slots.
//
// Each rounds where transformers' eager ops in the same dtype round (float32 norm
// statistics, results rounded to the activation dtype before the weight multiply),
// so fused and unfused paths agree to the last bit in float32 and within a rounding
// step in bfloat16. Rows run in parallel on torch's OpenMP threads.
#include "common.h"
#include "silu.h"
#include "vec.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace pagedserve {
namespace {

inline int threads_for(int64_t rows, int64_t row_elems) {
  // tiny batches are not worth waking a second thread for
  const int64_t work = rows * row_elems;
  return work < 32768 ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
}

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps, float* buf, float* wbuf) {
  load_row(x, buf, n);
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  load_row(w, wbuf, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = round_through<T>(wbuf[i] * round_through<T>(buf[i] * inv));
  store_row(buf, out, n);
}

// g[i] = silu(g[i]) * u[i], silu rounded to T first as eager torch rounds it.
template <typename T>
void silu_mul_row(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
  if constexpr (!std::is_same_v<T, c10::Half>) {  // float16 rounding has no vector form here
    using namespace vec;
    for (; i + kWidth <= n; i += kWidth) {
      const V x = load(g + i);
      V s = div(x, add(set1(1.0f), vec::exp(sub(zero(), x))));
      if constexpr (std::is_same_v<T, c10::BFloat16>) s = round_bf16(s);
      store(g + i, mul(s, load(u + i)));
    }
  }
#endif
  for (; i < n; ++i) g[i] = round_through<T>(g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}

#if defined(__AVX512F__)
// bfloat16 rows in registers, 16 at a time (n a multiple of 16): the same roundings as the loops
// above (round_bf16 is float_to_bf16_bits' round-to-nearest-even), without their float32
// scratch rows.
inline __m512 load_bf16(const c10::BFloat16* p) { return vec::load(p); }
inline void store_bf16(c10::BFloat16* p, __m512 rounded) {  // rounded: a bfloat16 value already
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
// store_bf16(p, round_bf16(v)) for a final result: with AVX512-BF16 one vcvtneps2bf16 (the same
// nearest-even rounding; it flushes values below 2^-126 to zero, which activations never reach)
inline void round_store_bf16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  store_bf16(p, vec::round_bf16(v));
#endif
}

void rms_norm_row_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* out, int64_t n, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load_bf16(x + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 normed = vec::round_bf16(_mm512_mul_ps(load_bf16(x + i), inv));
    round_store_bf16(out + i, _mm512_mul_ps(load_bf16(w + i), normed));
  }
}

// residual = round(x + residual); x = weight * rms_norm(residual)
void add_rms_norm_row_bf16(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w, int64_t n,
                           float eps) {
  for (int64_t i = 0; i < n; i += 16)
    round_store_bf16(residual + i, _mm512_add_ps(load_bf16(x + i), load_bf16(residual + i)));
  rms_norm_row_bf16(residual, w, x, n, eps);
}

// out = round(round(silu(gate)) * up), silu = gate / (1 + exp(-gate)) divided exactly (a Newton
// reciprocal moved 1 in 10^4 outputs by a bfloat16 step)
void silu_mul_row_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) round_store_bf16(out + i, silu_mul(load_bf16(gate + i), load_bf16(up + i)));
}

// One bfloat16 head row rotated (NeoX halves, `half` a multiple of 16) into dst, with rope_and_cache's
// roundings, 16 lanes at a time from registers instead of through float32 scratch rows.
inline void rotate_row_bf16(const c10::BFloat16* src, c10::BFloat16* dst, const float* c, const float* s,
                            int64_t half) {
  using vec::round_bf16;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x0 = load_bf16(src + i), x1 = load_bf16(src + i + half);
    const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
    const __m512 y0 = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x0, cv)), round_bf16(_mm512_mul_ps(x1, sv)));
    const __m512 y1 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, cv)), round_bf16(_mm512_mul_ps(x0, sv)));
    round_store_bf16(dst + i, y0);  // src may be dst: both halves were loaded first
    round_store_bf16(dst + i + half, y1);
  }
}
#endif

// A token's keys or values into its cache slot. Slots lie anywhere in the pool, so an ordinary store
// first reads the line from DRAM; whole aligned lines go out as streaming stores, which read nothing
// (64 tokens each in its own block, 30 layers: 0.9 ms against 1.2-1.4; 214 tokens 2.2 against 3.2; AMX Xeon).
inline void write_slot(void* dst, const void* src, int64_t bytes) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && bytes % 64 == 0) {
    for (int64_t i = 0; i < bytes; i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(static_cast<char*>(dst) + i),
                          _mm512_loadu_si512(static_cast<const char*>(src) + i));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Streaming stores are weakly ordered: fenced before the attention that reads them (another thread, maybe).
inline void finish_slot_writes() {
#if defined(__AVX512F__)
  _mm_sfence();
#endif
}

}  // namespace

// out = weight * rms_norm(x), x [rows, hidden]
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous(), "rms_norm: layout");
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (n % 16 == 0) {
#pragma omp parallel for num_threads(threads_for(rows, n))
        for (int64_t r = 0; r < rows; ++r) rms_norm_row_bf16(xp + r * xs, wp, op + r * os, n, static_cast<float>(eps));
        return;
      }
    }
#endif
#pragma omp parallel num_threads(threads_for(rows, n))
    {
      std::vector<float> buf(n), wbuf(n);
#pragma omp for
      for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(xp + r * xs, wp, op + r * os, n, static_cast<float>(eps), buf.data(), wbuf.data());
    }
  });
}

// residual += x (rounded to the dtype), then x = weight * rms_norm(residual); both in place.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "fused_add_rms_norm: layout");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  dispatch_float_types(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (n % 16 == 0) {
#pragma omp parallel for num_threads(threads_for(rows, n))
        for (int64_t r = 0; r < rows; ++r)
          add_rms_norm_row_bf16(xp + r * n, rp + r * n, wp, n, static_cast<float>(eps));
        return;
      }
    }
#endif
#pragma omp parallel num_threads(threads_for(rows, n))
    {
      std::vector<float> a(n), b(n), wbuf(n);
#pragma omp for
      for (int64_t r = 0; r < rows; ++r) {
        load_row(xp + r * n, a.data(), n);
        load_row(rp + r * n, b.data(), n);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) b[i] = round_through<scalar_t>(a[i] + b[i]);
        store_row(b.data(), rp + r * n, n);
        rms_norm_row(rp + r * n, wp, xp + r * n, n, static_cast<float>(eps), a.data(), wbuf.data());
      }
    }
  });
}

// out[rows, I] = silu(x[:, :I]) * x[:, I:], each rounded to the dtype as eager torch does.
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "silu_and_mul: layout");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  dispatch_float_types(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (inter % 16 == 0) {
#pragma omp parallel for num_threads(threads_for(rows, inter))
        for (int64_t r = 0; r < rows; ++r)
          silu_mul_row_bf16(xp + r * 2 * inter, xp + r * 2 * inter + inter, op + r * inter, inter);
        return;
      }
    }
#endif
#pragma omp parallel num_threads(threads_for(rows, inter))
    {
      std::vector<float> g(inter), u(inter);
#pragma omp for
      for (int64_t r = 0; r < rows; ++r) {
        load_row(xp + r * 2 * inter, g.data(), inter);
        load_row(xp + r * 2 * inter + inter, u.data(), inter);
        silu_mul_row<scalar_t>(g.data(), u.data(), inter);
        store_row(g.data(), op + r * inter, inter);
      }
    }
  });
}

// qkv [tokens, (heads + 2 * kv_heads) * head_dim]: rotates q in place (NeoX halves layout) and
// writes the rotated k and v at slot_mapping into the caches. cos_sin [max_pos, head_dim]
// holds cos in its first half and sin in its second, already in the activation dtype's values.
void rope_and_cache(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rope_and_cache: layout");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "cos_sin must be float32");
  const int64_t D = k_cache.size(3), half = D / 2, tokens = qkv.size(0);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width disagrees with the heads");
  const auto pos = positions.to(at::kLong).contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t max_pos = cos_sin.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " outside the rotary table");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " outside the KV pool");
  }
  // the cache may be stored in another dtype than the activations (--kv-cache-dtype)
  dispatch_float_types(qkv.scalar_type(), "rope_and_cache", [&](auto tag) {
  dispatch_float_types(k_cache.scalar_type(), "rope_and_cache cache", [&](auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    scalar_t* base = qkv.data_ptr<scalar_t>();
    cache_t* kc = k_cache.data_ptr<cache_t>();
    cache_t* vc = v_cache.data_ptr<cache_t>();
    const int64_t row_stride = qkv.stride(0), kv_width = num_kv_heads * D;
#pragma omp parallel num_threads(threads_for(tokens, (num_heads + num_kv_heads) * D))
    {
      std::vector<float> x(D), y(D);
      std::vector<scalar_t> kbuf(kv_width);  // a token's rotated keys, on their way to the cache
#pragma omp for nowait
      for (int64_t t = 0; t < tokens; ++t) {
        const float* c = cs + pp[t] * D;
        const float* s = c + half;
        scalar_t* row = base + t * row_stride;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
          if (half % 16 == 0) {  // 1,800 tokens, Xeon: 0.27 ms a layer, the loop below 0.60
            for (int64_t h = 0; h < num_heads; ++h) rotate_row_bf16(row + h * D, row + h * D, c, s, half);
            for (int64_t h = 0; h < num_kv_heads; ++h)
              rotate_row_bf16(row + (num_heads + h) * D, kbuf.data() + h * D, c, s, half);
            write_slot(kc + sp[t] * kv_width, kbuf.data(), kv_width * sizeof(scalar_t));
            write_slot(vc + sp[t] * kv_width, row + (num_heads + num_kv_heads) * D, kv_width * sizeof(scalar_t));
            continue;
          }
        }
#endif
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          scalar_t* src = row + h * D;
          load_row(src, x.data(), D);
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            using T = scalar_t;
            y[i] = round_through<T>(round_through<T>(x[i] * c[i]) - round_through<T>(x[i + half] * s[i]));
            y[i + half] = round_through<T>(round_through<T>(x[i + half] * c[i]) + round_through<T>(x[i] * s[i]));
          }
          if (h < num_heads)
            store_row(y.data(), src, D);
          else
            store_row(y.data(), kc + sp[t] * kv_width + (h - num_heads) * D, D);
        }
        const scalar_t* v = row + (num_heads + num_kv_heads) * D;
        cache_t* v_dst = vc + sp[t] * kv_width;
        if constexpr (std::is_same_v<scalar_t, cache_t>) {
          std::memcpy(v_dst, v, kv_width * sizeof(scalar_t));
        } else {
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            load_row(v + h * D, x.data(), D);
            store_row(x.data(), v_dst + h * D, D);
          }
        }
      }
      finish_slot_writes();
    }
  });
  });
}

}  // namespace pagedserve
