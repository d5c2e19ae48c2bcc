// Paged attention on the CPU: decode and (chunked) prefill read K/V in place through
// the block table.
//
// Layout as kernels/reference.py: query [tokens, heads, head_dim] (rows may be strided,
// e.g. a view into the fused QKV output), k/v cache [blocks, block_size, kv_heads,
// head_dim], block_tables [seqs, max_blocks], query_start_loc [seqs + 1], context_lens
// [seqs]. One work item is (sequence, KV head, tile of query tokens): its tile's
// tokens x the query heads sharing that KV head form the rows of one online softmax,
// so grouped-query attention reads each K/V block once per tile and never copies it
// per head. Work is the sequence's own context (blocks past the tile's last position,
// or before its sliding window, are never touched); items run in parallel on torch's
// OpenMP threads with dynamic scheduling, as contexts differ (a tile's KV heads claimed together
// where tiles outnumber threads), each thread claiming its next item before it runs the current one, which fetches the next one's first blocks into L2
// (`NextItemFetch`): blocks lie anywhere in the pool, where no hardware prefetcher finds
// them, and a decode item computes in less time than DRAM takes to deliver it. The entry point checks every
// block id a context reads against the pool, and each context against its table, once per
// sequence before any item runs: a bad table is a RuntimeError, never an out-of-bounds read.
//
// Two ways to run an item. With AVX-512, head_dim 64 or 128 and blocks a multiple of 16
// tokens, `run_item_two_pass`: all the item's scores first, then one softmax per row, then the
// values; bfloat16 queries and keys are dotted in pairs (AVX512-BF16) where the CPU has it, and so
// are bfloat16 probabilities and values (decode attention from DRAM: 0.94-0.96x the time of widening
// every value to float32 for an FMA; Zen 4, 64 x 200 to 1 x 8,000 tokens, outputs' error unchanged).
// Elsewhere (AVX2, other head sizes) `run_item_simd`, an online softmax block by block, or the
// portable loop. Both compute each row the same way whatever else the call holds.
#include "common.h"
#include "vec.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace pagedserve {
namespace {

constexpr int64_t kQueryTile = 16;  // query tokens per work item in chunks longer than one

struct WorkItem {
  int64_t seq, tile_start, tile_end, kv_head;
};

struct Scratch {
  std::vector<float> q, acc, m, l, scores, k, v;
  std::vector<c10::BFloat16> qb;  // query rows in bfloat16 (the two-pass path's pair dot products)
  std::vector<c10::BFloat16> pb;  // probabilities in bfloat16 (its values pass, by pair dot products)
  const WorkItem* next = nullptr;  // the item this thread runs after this one (none: the last)
  const WorkItem* fetched = nullptr;  // the item whose first blocks the one before it fetched
};

// Loads the item's query rows (tile tokens x the heads sharing its KV head), scaled, and
// resets their softmax state.
template <typename T>
void init_rows(const WorkItem& w, Scratch& s, const T* query, int64_t q_tok_stride, int64_t q_head_stride,
               const int64_t* qsl, int64_t group, int64_t D, float scale) {
  const int64_t rows = (w.tile_end - w.tile_start) * group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = qsl[w.seq] + w.tile_start + r / group;
    const int64_t head = w.kv_head * group + r % group;
    float* qr = &s.q[r * D];
    load_row(query + tok * q_tok_stride + head * q_head_stride, qr, D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) qr[d] *= scale;
    std::fill_n(&s.acc[r * D], D, 0.0f);
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.0f;
  }
}

// Row r's running maximum raised to cover a block's scores sc[lo..hi], its running sum and output
// rescaled to it; returns the new maximum.
inline float raise_max(Scratch& s, int64_t r, const float* sc, int64_t lo, int64_t hi, int64_t D) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j <= hi; ++j) block_max = std::max(block_max, sc[j]);
  const float m_new = std::max(s.m[r], block_max);
  if (s.m[r] != m_new) {
    const float correction = s.m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_approx(s.m[r] - m_new);
    s.l[r] *= correction;
    float* acc = &s.acc[r * D];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
    s.m[r] = m_new;
  }
  return m_new;
}

// One online-softmax update of row r by a block's scores sc[lo..hi]: rescales its running sum
// and output to the new maximum, and turns sc[0..block_size) into probabilities (0 outside lo..hi).
inline void softmax_update(Scratch& s, int64_t r, float* sc, int64_t lo, int64_t hi, int64_t block_size,
                           int64_t D) {
  const float m_new = raise_max(s, r, sc, lo, hi, D);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < block_size; ++j) {
    const float p = (j >= lo && j <= hi) ? exp_approx(sc[j] - m_new) : 0.0f;
    sc[j] = p;
    sum += p;
  }
  s.l[r] += sum;
}

// Divides each row's output by its softmax sum and stores it in the output's dtype.
template <typename T>
void store_rows(const WorkItem& w, Scratch& s, T* out, int64_t o_tok_stride, int64_t o_head_stride,
                const int64_t* qsl, int64_t group, int64_t D) {
  const int64_t rows = (w.tile_end - w.tile_start) * group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = qsl[w.seq] + w.tile_start + r / group;
    const int64_t head = w.kv_head * group + r % group;
    float* acc = &s.acc[r * D];
    const float inv = s.l[r] > 0.0f ? 1.0f / s.l[r] : 0.0f;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
    store_row(acc, out + tok * o_tok_stride + head * o_head_stride, D);
  }
}

// Where an item's rows sit: positions first_pos + tile_start.. (the sequence's new tokens start at
// first_pos), rows = its tokens x the query heads of its KV head; no row sees a key before
// lowest_pos (sliding window) or after last_pos.
struct ItemSpan {
  int64_t ctx, first_pos, rows, last_pos, lowest_pos;

  ItemSpan(const WorkItem& w, const int64_t* qsl, const int64_t* ctx_lens, int64_t group, int64_t window)
      : ctx(ctx_lens[w.seq]),
        first_pos(ctx - (qsl[w.seq + 1] - qsl[w.seq])),
        rows((w.tile_end - w.tile_start) * group),
        last_pos(first_pos + w.tile_end - 1),
        lowest_pos(window > 0 ? std::max<int64_t>(0, first_pos + w.tile_start - window + 1) : 0) {}
};

template <typename T, typename C>
void run_item_portable(const WorkItem& w, Scratch& s, const T* query, int64_t q_tok_stride, int64_t q_head_stride,
              const C* k_cache, const C* v_cache, T* out, int64_t o_tok_stride, int64_t o_head_stride,
              const int64_t* tables, int64_t table_stride, const int64_t* qsl, const int64_t* ctx_lens,
              int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
              int64_t window) {
  const int64_t D = head_dim, BS = block_size;
  const auto [ctx, first_pos, rows, last_pos, lowest_pos] = ItemSpan(w, qsl, ctx_lens, group, window);
  init_rows(w, s, query, q_tok_stride, q_head_stride, qsl, group, D, scale);
  const int64_t token_stride = num_kv_heads * D;
  const int64_t* table = tables + w.seq * table_stride;
  float* kt = s.k.data();  // the block's keys transposed, [D][BS]: scores come out BS lanes at a time
  float* sc = s.scores.data();
  for (int64_t b = lowest_pos / BS; b <= last_pos / BS; ++b) {
    const int64_t block_start = b * BS;
    const int64_t n_tok = std::min(BS, ctx - block_start);
    const int64_t base = table[b] * BS * token_stride + w.kv_head * D;
    float* row = s.v.data();
    for (int64_t j = 0; j < n_tok; ++j) {
      load_row(k_cache + base + j * token_stride, row, D);
      for (int64_t d = 0; d < D; ++d) kt[d * BS + j] = row[d];
    }
    for (int64_t j = n_tok; j < BS; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * BS + j] = 0.0f;
    const float* vb;
    int64_t v_stride;
    if constexpr (std::is_same_v<C, float>) {
      vb = v_cache + base;
      v_stride = token_stride;
    } else {
      for (int64_t j = 0; j < n_tok; ++j) load_row(v_cache + base + j * token_stride, &s.v[j * D], D);
      vb = s.v.data();
      v_stride = D;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t q_pos = first_pos + w.tile_start + r / group;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, q_pos - window + 1) : 0;
      const int64_t j_lo = std::max<int64_t>(0, lo - block_start);
      const int64_t j_hi = std::min(n_tok - 1, q_pos - block_start);
      if (j_lo > j_hi) continue;
      const float* qr = &s.q[r * D];
#pragma omp simd
      for (int64_t j = 0; j < BS; ++j) sc[j] = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qr[d];
        const float* kd = kt + d * BS;
#pragma omp simd
        for (int64_t j = 0; j < BS; ++j) sc[j] += qd * kd[j];
      }
      softmax_update(s, r, sc, j_lo, j_hi, BS, D);
      float* acc = &s.acc[r * D];
      for (int64_t j = j_lo; j <= j_hi; ++j) {
        const float p = sc[j];
        const float* vr = vb + j * v_stride;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * vr[d];
      }
    }
  }
  store_rows(w, s, out, o_tok_stride, o_head_stride, qsl, group, D);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
// Fetches a block's rows (D elements each, token_stride apart) into the cache: blocks sit anywhere in
// the pool, so the hardware prefetchers cannot guess the next one. kL2: into L2 only (prefetcht2),
// where many more fetches can be in flight than into L1.
template <bool kL2 = false, typename C>
inline void prefetch_block(const C* cache, int64_t base, int64_t block_size, int64_t token_stride, int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(C));
  for (int64_t j = 0; j < block_size; ++j)
    for (int64_t off = 0; off < row_bytes; off += 64) {
      const char* line = reinterpret_cast<const char*>(cache + base + j * token_stride) + off;
      // asm volatile: GCC 12 dropped _mm_prefetch calls from this loop once inlined
      if constexpr (kL2)
        asm volatile("prefetcht2 %0" : : "m"(*line));
      else
        asm volatile("prefetcht0 %0" : : "m"(*line));
    }
}

// The first blocks (up to kAhead) of the item this thread runs next, fetched into L2 a few at a time
// while the current item computes: issued in one burst, they held the loads up until DRAM answered.
// Keys first then values (`keys_first`, for a pass over keys before one over values), or each block's
// keys and values together.
template <typename C>
struct NextItemFetch {
  const C* k_cache;
  const C* v_cache;
  int64_t block_size, token_stride, D;
  bool keys_first;
  const int64_t* table = nullptr;
  int64_t b0 = 0, n = 0, off = 0, issued = 0;

  NextItemFetch(const C* k, const C* v, int64_t bs, int64_t ts, int64_t d, bool kf, const WorkItem* next,
                const int64_t* tables, int64_t table_stride, const int64_t* qsl, const int64_t* ctx_lens, int64_t group,
                int64_t window, int64_t ahead)
      : k_cache(k), v_cache(v), block_size(bs), token_stride(ts), D(d), keys_first(kf) {
    if (next == nullptr) return;
    const ItemSpan nx(*next, qsl, ctx_lens, group, window);
    table = tables + next->seq * table_stride;
    b0 = nx.lowest_pos / bs;
    n = std::min(ahead, nx.last_pos / bs - b0 + 1);
    off = next->kv_head * d;
  }
  int64_t total() const { return 2 * n; }
  // issues up to `count` more block fetches (one block's keys, or its values, each)
  void issue(int64_t count) {
    for (; count > 0 && issued < total(); --count, ++issued) {
      const bool values = keys_first ? issued >= n : issued % 2 == 1;
      const int64_t a = b0 + (keys_first ? issued % n : issued / 2);
      prefetch_block<true>(values ? v_cache : k_cache, table[a] * block_size * token_stride + off, block_size,
                           token_stride, D);
    }
  }
  // spread over `slots` calls of at(slot), ending with the last
  void at(int64_t slot, int64_t slots) {
    const int64_t per_slot = (total() + slots - 1) / slots;
    if (slot >= slots - total()) issue(per_slot);
  }
};

// One online-softmax update of row r (as softmax_update), with the exponentials kWidth lanes at a
// time: sc[0..block_size) becomes probabilities, 0 outside lo..hi.
inline void softmax_update_simd(Scratch& s, int64_t r, float* sc, int64_t lo, int64_t hi, int64_t block_size,
                                int64_t D) {
  using namespace vec;
  const float m_new = raise_max(s, r, sc, lo, hi, D);
  // lanes outside lo..hi may hold anything finite or not: exp clamps its input, and they are zeroed below
  const V mv = set1(m_new);
  int64_t j = 0;
  for (; j + kWidth <= block_size; j += kWidth) store(sc + j, vec::exp(sub(load(sc + j), mv)));
  for (; j < block_size; ++j) sc[j] = exp_approx(sc[j] - m_new);
  std::fill(sc, sc + lo, 0.0f);
  std::fill(sc + hi + 1, sc + block_size, 0.0f);
  float sum = 0.0f;
  for (int64_t k = lo; k <= hi; ++k) sum += sc[k];
  s.l[r] += sum;
}

// acc[0..n * kWidth) += sum over j in lo..hi of p[j] * values[j], the values rows D floats apart;
// n = CH, or `vectors` when CH is 0. With CH a constant the running output lives in registers (with
// a runtime count the compiler kept it on the stack, and every FMA waited on a store and a load).
template <int CH>
inline void add_values(float* acc, const float* p, const float* values, int64_t lo, int64_t hi, int64_t D,
                       int64_t vectors = CH) {
  using namespace vec;
  const int64_t n = CH ? CH : vectors;
  V out[CH ? CH : 16];
  for (int64_t c = 0; c < n; ++c) out[c] = load(acc + c * kWidth);
  for (int64_t j = lo; j <= hi; ++j) {
    const V pv = set1(p[j]);
    const float* vj = values + j * D;
    for (int64_t c = 0; c < n; ++c) out[c] = fmadd(pv, load(vj + c * kWidth), out[c]);
  }
  for (int64_t c = 0; c < n; ++c) store(acc + c * kWidth, out[c]);
}

// The same computation with K/V rows read straight from the cache into vector registers
// (widened from bfloat16/float16 on load): keys are dotted four at a time with each query row
// of the item (a row's four scores share one horizontal reduction); each block's values are widened once into scratch, then
// every row adds its probabilities times them into an output kept in registers.
template <typename T, typename C>
void run_item_simd(const WorkItem& w, Scratch& s, const T* query, int64_t q_tok_stride, int64_t q_head_stride,
                   const C* k_cache, const C* v_cache, T* out, int64_t o_tok_stride, int64_t o_head_stride,
                   const int64_t* tables, int64_t table_stride, const int64_t* qsl, const int64_t* ctx_lens,
                   int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                   int64_t window) {
  using namespace vec;
  constexpr int kMaxChunks = 16;  // head_dim up to 16 vectors (256 with AVX-512, 128 with AVX2)
  const int64_t D = head_dim, BS = block_size, chunks = D / kWidth;
  const auto [ctx, first_pos, rows, last_pos, lowest_pos] = ItemSpan(w, qsl, ctx_lens, group, window);
  init_rows(w, s, query, q_tok_stride, q_head_stride, qsl, group, D, scale);
  const int64_t token_stride = num_kv_heads * D;
  const int64_t* table = tables + w.seq * table_stride;
  float* sc = s.scores.data();  // [rows][BS]: scores, then probabilities
  float* vb = s.v.data();       // [BS][D]: the block's values in float32
  V kv[kMaxChunks];
  // keys and values into L2 kL2Ahead blocks ahead, as run_item_two_pass does (AVX2 build, 64
  // sequences x 200 tokens and 8 x 4,000 from DRAM: 0.52x and 0.41x the time of fetching only the
  // next block), and the next item's first blocks over this item's last ones (64 x 200, 32 x 400
  // and 16 x 1,000 then took 0.59-0.79x the time with a bfloat16 cache, 0.88-0.99x with float32)
  constexpr int64_t kL2Ahead = 32;
  auto fetch_l2 = [&](int64_t b) {
    const int64_t at = table[b] * BS * token_stride + w.kv_head * D;
    prefetch_block<true>(k_cache, at, BS, token_stride, D);
    prefetch_block<true>(v_cache, at, BS, token_stride, D);
  };
  const int64_t b0 = lowest_pos / BS, b1 = last_pos / BS;
  NextItemFetch<C> next(k_cache, v_cache, BS, token_stride, D, false, s.next, tables, table_stride, qsl, ctx_lens,
                        group, window, kL2Ahead);
  if (s.fetched != &w)
    for (int64_t b = b0; b < b0 + kL2Ahead && b <= b1; ++b) fetch_l2(b);
  for (int64_t b = b0; b <= b1; ++b) {
    if (b + kL2Ahead <= b1) fetch_l2(b + kL2Ahead);
    next.at(b - b0, b1 - b0 + 1);
    const int64_t block_start = b * BS;
    const int64_t n_tok = std::min(BS, ctx - block_start);
    const int64_t base = table[b] * BS * token_stride + w.kv_head * D;
    // key positions row r may see in this block: [j_lo(r), j_hi(r)]
    auto j_lo = [&](int64_t r) {
      const int64_t q_pos = first_pos + w.tile_start + r / group;
      return window > 0 ? std::max<int64_t>(0, q_pos - window + 1 - block_start) : 0;
    };
    auto j_hi = [&](int64_t r) { return std::min(n_tok - 1, first_pos + w.tile_start + r / group - block_start); };
    if (b < last_pos / BS) {  // the next block's rows, while this one computes
      const int64_t next = table[b + 1] * BS * token_stride + w.kv_head * D;
      prefetch_block(k_cache, next, BS, token_stride, D);
      prefetch_block(v_cache, next, BS, token_stride, D);
    }
    int64_t j = 0;
    // four keys at a time, each with its own accumulator: four independent FMA chains per row
    // and one shared horizontal reduction, where one key at a time waits on a single chain
    for (; j + 4 <= n_tok; j += 4) {
      const C* k0 = k_cache + base + j * token_stride;
      const C* k1 = k0 + token_stride;
      const C* k2 = k1 + token_stride;
      const C* k3 = k2 + token_stride;
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = &s.q[r * D];
        V a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
        for (int64_t c = 0; c < chunks; ++c) {
          const V qv = load(qr + c * kWidth);
          a0 = fmadd(qv, load(k0 + c * kWidth), a0);
          a1 = fmadd(qv, load(k1 + c * kWidth), a1);
          a2 = fmadd(qv, load(k2 + c * kWidth), a2);
          a3 = fmadd(qv, load(k3 + c * kWidth), a3);
        }
        reduce_add4(a0, a1, a2, a3, sc + r * BS + j);
      }
    }
    for (; j < n_tok; ++j) {
      const C* kr = k_cache + base + j * token_stride;
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load(kr + c * kWidth);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = &s.q[r * D];
        V acc = zero();
        for (int64_t c = 0; c < chunks; ++c) acc = fmadd(load(qr + c * kWidth), kv[c], acc);
        sc[r * BS + j] = reduce_add(acc);
      }
    }
    for (int64_t j = 0; j < n_tok; ++j) {
      const C* vr = v_cache + base + j * token_stride;
      for (int64_t c = 0; c < chunks; ++c) store(vb + j * D + c * kWidth, load(vr + c * kWidth));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = j_lo(r), hi = j_hi(r);
      if (lo > hi) continue;  // nothing visible here: the row's state stands
      float* row = sc + r * BS;
      softmax_update_simd(s, r, row, lo, hi, BS, D);
      float* acc_r = &s.acc[r * D];
      switch (chunks) {  // head_dim 64 or 128: the output stays in registers
        case 4: add_values<4>(acc_r, row, vb, lo, hi, D); break;
        case 8: add_values<8>(acc_r, row, vb, lo, hi, D); break;
        default: add_values<0>(acc_r, row, vb, lo, hi, D, chunks);
      }
    }
  }
  store_rows(w, s, out, o_tok_stride, o_head_stride, qsl, group, D);
  s.fetched = s.next;
}
#endif

#if defined(__AVX512F__)
// The sums of 16 vectors' lanes as one vector: lane j holds the sum of a[j]'s 16 lanes. Every lane
// is summed in the same order ((i, i+8), then (i, i+4), (i, i+2), (i, i+1)), so a key's score is the
// same bits in whichever slot of whichever call it lands.
inline __m512 sum16(const __m512* a) {
  __m512 r[8], s[4];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // s[i]'s quarter k: a[4i + k] folded to 4 lanes
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  const __m512 t0 = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x44), _mm512_shuffle_ps(s[0], s[1], 0xEE));
  const __m512 t1 = _mm512_add_ps(_mm512_shuffle_ps(s[2], s[3], 0x44), _mm512_shuffle_ps(s[2], s[3], 0xEE));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x88), _mm512_shuffle_ps(t0, t1, 0xDD));
  // u's lane 4k + m holds a[4m + k]
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), u);
}

// The 16 scores of one query row against 16 keys (rows of the cache, or of zeros past the context).
template <int CH, typename C>
inline __m512 scores16(const float* q, const C* const* keys) {
  __m512 acc[16];
  for (int quad = 0; quad < 4; ++quad) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const C *k0 = keys[4 * quad], *k1 = keys[4 * quad + 1], *k2 = keys[4 * quad + 2], *k3 = keys[4 * quad + 3];
    for (int c = 0; c < CH; ++c) {
      const __m512 qv = vec::load(q + c * 16);
      a0 = _mm512_fmadd_ps(qv, vec::load(k0 + c * 16), a0);
      a1 = _mm512_fmadd_ps(qv, vec::load(k1 + c * 16), a1);
      a2 = _mm512_fmadd_ps(qv, vec::load(k2 + c * 16), a2);
      a3 = _mm512_fmadd_ps(qv, vec::load(k3 + c * 16), a3);
    }
    acc[4 * quad] = a0;
    acc[4 * quad + 1] = a1;
    acc[4 * quad + 2] = a2;
    acc[4 * quad + 3] = a3;
  }
  return sum16(acc);
}

#if defined(__AVX512BF16__)
// scores16 for bfloat16 queries and keys by bfloat16 pair dot products (each product exact in float32,
// one rounding per pair), scaled after: a quarter of the instructions of widening every key.
template <int CH>
inline __m512 scores16_bf16(const c10::BFloat16* q, const c10::BFloat16* const* keys, float scale) {
  constexpr int kPairs = CH / 2;  // 32 bfloat16 to a vector
  __m512bh qv[kPairs];
  for (int c = 0; c < kPairs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < kPairs; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(keys[j] + c * 32));
    acc[j] = a;
  }
  return _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
}
#endif

// acc[r][..] += sum over tokens j of p[r][j] * values[j] for NR rows (outputs in registers), the
// probabilities of row r at p + r * p_stride, the values rows `v_stride` elements apart.
template <int CH, int NR, typename C>
inline void add_values_rows(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, const C* values,
                            int64_t v_stride, int64_t n_tok) {
  __m512 out[NR][CH];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c) out[r][c] = _mm512_loadu_ps(acc + r * acc_stride + c * 16);
  for (int64_t j = 0; j < n_tok; ++j) {
    __m512 v[CH];
    for (int c = 0; c < CH; ++c) v[c] = vec::load(values + j * v_stride + c * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * p_stride + j]);
      for (int c = 0; c < CH; ++c) out[r][c] = _mm512_fmadd_ps(pv, v[c], out[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + r * acc_stride + c * 16, out[r][c]);
}

// f(std::integral_constant<int, NR>{}) for nr rows, 1 to 6 (more: 6), so NR's outputs stay in registers.
template <typename F>
inline void with_row_count(int64_t nr, F&& f) {
  switch (nr) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    default: return f(std::integral_constant<int, 6>{});
  }
}

#if defined(__AVX512BF16__)
// add_values_rows for bfloat16 probabilities and values, two tokens to a pair dot product: tokens
// (j, j+1) of the values interleaved (unpacklo/hi_epi16), each row's (p[j], p[j+1]) broadcast as one
// pair. The outputs are in pair order, each 32 of head_dim as [d 0-3, 8-11, 16-19, 24-27 | 4-7, ...]
// (`from_pair_order` undoes it). Pairs start at even positions, so a token pairs with the same
// neighbour in any call: tokens outside [j_lo, j_hi] are rows of zeros (`zero_row`).
template <int CH, int NR>
inline void add_values_rows_pairs(float* acc, int64_t acc_stride, const c10::BFloat16* p, int64_t p_stride,
                                  const c10::BFloat16* values, int64_t v_stride, int64_t j_lo, int64_t j_hi,
                                  const c10::BFloat16* zero_row) {
  __m512 out[NR][CH];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c) out[r][c] = _mm512_loadu_ps(acc + r * acc_stride + c * 16);
  for (int64_t j = j_lo & ~int64_t{1}; j <= j_hi; j += 2) {
    const c10::BFloat16* a = j >= j_lo ? values + j * v_stride : zero_row;
    const c10::BFloat16* b = j + 1 <= j_hi ? values + (j + 1) * v_stride : zero_row;
    __m512bh v[CH];
    for (int c = 0; c < CH / 2; ++c) {
      const __m512i va = _mm512_loadu_si512(a + c * 32), vb = _mm512_loadu_si512(b + c * 32);
      v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(va, vb);
      v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(va, vb);
    }
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * p_stride + j, sizeof(pair));
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < CH; ++c) out[r][c] = _mm512_dpbf16_ps(out[r][c], v[c], pv);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + r * acc_stride + c * 16, out[r][c]);
}

// A row of add_values_rows_pairs' outputs (16 * CH floats) back in head_dim order, in place.
template <int CH>
inline void from_pair_order(float* acc) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < CH; c += 2) {
    const __m512 lo = _mm512_loadu_ps(acc + c * 16), hi = _mm512_loadu_ps(acc + (c + 1) * 16);
    _mm512_storeu_ps(acc + c * 16, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(acc + (c + 1) * 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#endif

// One item in three passes over its context, head_dim 16 * CH and blocks a multiple of 16 tokens:
// every row's scores against every key it may see (16 keys to a vector, one shared reduction),
// then each row's softmax over its whole context at once (no running maximum, no rescaling),
// then the values, each widened once per group of rows that adds it (bfloat16 ones: paired). A row
// computes the same bits in any tile: keys it may not see get probability 0, and adding 0 changes
// nothing; pairs start at even positions.
template <int CH, typename T, typename C>
void run_item_two_pass(const WorkItem& w, Scratch& s, const T* query, int64_t q_tok_stride, int64_t q_head_stride,
                       const C* k_cache, const C* v_cache, T* out, int64_t o_tok_stride, int64_t o_head_stride,
                       const int64_t* tables, int64_t table_stride, const int64_t* qsl, const int64_t* ctx_lens,
                       int64_t group, int64_t num_kv_heads, int64_t block_size, float scale, int64_t window) {
  constexpr int64_t D = 16 * CH;
  constexpr int kRowGroup = CH == 4 ? 6 : 2;  // rows whose outputs stay in registers beside one value row
  // Into L2: the item's first kL2Ahead blocks (keys and values) before anything else (unless the item
  // before it fetched them), then in each pass the block kL2Ahead ahead; and the next item's first
  // kL2Ahead blocks (below), so that DRAM keeps fetching while this item computes (a decode item at
  // 200 tokens computes in less time than its blocks take to arrive). Fetching into L1 too, two
  // blocks ahead, only cost instructions once L2 held them: without it and with the next item's
  // fetch, 30 layers' decode attention from DRAM took 0.87-0.99x the time at 64 sequences x 200
  // tokens, 0.85-0.93x at 16 x 1,000, 0.80-0.83x at 8 x 4,000 and 0.64-0.73x at 1 x 8,000 (Zen 4).
  constexpr int64_t kL2Ahead = 32;  // 128 KB of bfloat16 keys and values at head_dim 64
  const int64_t BS = block_size;
  const auto [ctx, first_pos, rows, last_pos, lowest_pos] = ItemSpan(w, qsl, ctx_lens, group, window);
  init_rows(w, s, query, q_tok_stride, q_head_stride, qsl, group, D, scale);
  const int64_t token_stride = num_kv_heads * D;
  const int64_t* table = tables + w.seq * table_stride;
  const int64_t b0 = lowest_pos / BS, b1 = last_pos / BS;
  const int64_t span = (b1 - b0 + 1) * BS;  // score slots per row: key position b0 * BS + i at slot i
  if (static_cast<int64_t>(s.scores.size()) < rows * span) s.scores.resize(rows * span);
  float* sc = s.scores.data();
  static const C zeros[16 * 16] = {};
  auto row_pos = [&](int64_t r) { return first_pos + w.tile_start + r / group; };
  auto row_lo = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, row_pos(r) - window + 1) : 0; };
  auto block_base = [&](int64_t b) { return table[b] * BS * token_stride + w.kv_head * D; };
#if defined(__AVX512BF16__)
  constexpr bool kPairDots = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool kPairDots = false;
#endif
  if constexpr (kPairDots) {  // the query rows as they are (bfloat16), the scale applied to the scores
    if (static_cast<int64_t>(s.qb.size()) < rows * D) s.qb.resize(rows * D);
    if (static_cast<int64_t>(s.pb.size()) < rows * span) s.pb.resize(rows * span);
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(query + (qsl[w.seq] + w.tile_start + r / group) * q_tok_stride +
                      (w.kv_head * group + r % group) * q_head_stride, D, &s.qb[r * D]);
  }
  auto score_row = [&](int64_t r, const C* const* keys) {
#if defined(__AVX512BF16__)
    if constexpr (kPairDots) return scores16_bf16<CH>(&s.qb[r * D], keys, scale);
#endif
    return scores16<CH>(&s.q[r * D], keys);
  };

  auto fetch_l2 = [&](const C* cache, int64_t b) { prefetch_block<true>(cache, block_base(b), BS, token_stride, D); };
  if (s.fetched != &w)
    for (int64_t a = b0; a < b0 + kL2Ahead && a <= b1; ++a) {
      fetch_l2(k_cache, a);
      fetch_l2(v_cache, a);
    }

  // The next item's first blocks (its keys, then its values). Behind a short item (fewer than kL2Ahead
  // blocks), one fetch per block of its two passes, timed to end with them: issued in one burst they
  // held the loads up until DRAM had answered (30 layers' decode attention from DRAM, 64 sequences x
  // 200 tokens, 32 x 400 and 64 x 120, took 0.74-0.83x the time spread, Zen 4). Behind a long item,
  // in one burst once its keys are scored: spread over its values pass, 16 x 1,000 took 1.1x.
  NextItemFetch<C> next(k_cache, v_cache, BS, token_stride, D, true, s.next, tables, table_stride, qsl, ctx_lens,
                        group, window, kL2Ahead);
  const int64_t slots = 2 * (b1 - b0 + 1);
  const bool spread = b1 - b0 + 1 < kL2Ahead;

  for (int64_t b = b0; b <= b1; ++b) {
    if (b + kL2Ahead <= b1) fetch_l2(k_cache, b + kL2Ahead);
    if (spread) next.at(b - b0, slots);
    const int64_t n_tok = std::min(BS, ctx - b * BS);
    const C* block_keys = k_cache + block_base(b);
    for (int64_t j0 = 0; j0 < BS; j0 += 16) {
      const C* keys[16];
      for (int64_t j = 0; j < 16; ++j) keys[j] = j0 + j < n_tok ? block_keys + (j0 + j) * token_stride : zeros;
      for (int64_t r = 0; r < rows; ++r) {
        if (b * BS + j0 > row_pos(r) || b * BS + j0 + 15 < row_lo(r)) continue;  // masked in the softmax
        _mm512_storeu_ps(sc + r * span + (b - b0) * BS + j0, score_row(r, keys));
      }
    }
  }

  if (!spread) next.issue(next.total());
  // a long context's first values left L2 while the keys streamed past: fetch them again
  if (b1 - b0 >= kL2Ahead)
    for (int64_t a = b0; a < b0 + kL2Ahead; ++a) fetch_l2(v_cache, a);

  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = sc + r * span;
    const __m512i lo = _mm512_set1_epi32(static_cast<int>(row_lo(r) - b0 * BS));
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(row_pos(r) - b0 * BS));
    auto visible = [&](int64_t i) {
      const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i)));
      return static_cast<__mmask16>(_mm512_cmp_epi32_mask(pos, lo, _MM_CMPINT_NLT) &
                                    _mm512_cmp_epi32_mask(pos, hi, _MM_CMPINT_LE));
    };
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < span; i += 16) mv = _mm512_mask_max_ps(mv, visible(i), mv, _mm512_loadu_ps(row + i));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < span; i += 16) {
      __m512 p = _mm512_maskz_mov_ps(visible(i), vec::exp(_mm512_sub_ps(_mm512_loadu_ps(row + i), m)));
#if defined(__AVX512BF16__)
      if constexpr (kPairDots) {  // the values pass weighs by the rounded p: the sum is theirs too
        const __m256bh pb = _mm512_cvtneps_pbh(p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&s.pb[r * span + i]), (__m256i)pb);
        p = _mm512_cvtpbh_ps(pb);
      }
#endif
      if constexpr (!kPairDots) _mm512_storeu_ps(row + i, p);
      sum = _mm512_add_ps(sum, p);
    }
    s.l[r] = _mm512_reduce_add_ps(sum);
  }

  for (int64_t b = b0; b <= b1; ++b) {
    if (b + kL2Ahead <= b1) fetch_l2(v_cache, b + kL2Ahead);
    if (spread) next.at(b1 - b0 + 1 + b - b0, slots);
    // no row sees a key outside [lowest_pos, last_pos]
    const int64_t j_lo = std::max<int64_t>(0, lowest_pos - b * BS);
    const int64_t j_hi = std::min(BS - 1, last_pos - b * BS);
    if (j_lo > j_hi) continue;
#if defined(__AVX512BF16__)
    if constexpr (kPairDots) {
      const c10::BFloat16* pb = s.pb.data() + (b - b0) * BS;
      for (int64_t r = 0; r < rows; r += kRowGroup)
        with_row_count(std::min<int64_t>(kRowGroup, rows - r), [&](auto nr) {
          add_values_rows_pairs<CH, nr>(&s.acc[r * D], D, pb + r * span, span, v_cache + block_base(b),
                                        token_stride, j_lo, j_hi, zeros);
        });
      continue;
    }
#endif
    const float* p = sc + (b - b0) * BS + j_lo;
    const C* values = v_cache + block_base(b) + j_lo * token_stride;
    for (int64_t r = 0; r < rows; r += kRowGroup)
      with_row_count(std::min<int64_t>(kRowGroup, rows - r), [&](auto nr) {
        add_values_rows<CH, nr>(&s.acc[r * D], D, p + r * span, span, values, token_stride, j_hi - j_lo + 1);
      });
  }
#if defined(__AVX512BF16__)
  if constexpr (kPairDots)
    for (int64_t r = 0; r < rows; ++r) from_pair_order<CH>(&s.acc[r * D]);
#endif
  store_rows(w, s, out, o_tok_stride, o_head_stride, qsl, group, D);
  // behind a short item the next one's first blocks are on their way and it skips fetching them; behind
  // a long one it fetches them again at its start, as before the spread fetches (spreading there and
  // skipping together took 1.1x the time at 16 x 1,000)
  s.fetched = spread ? s.next : nullptr;
}
#endif

template <typename T, typename C>
void run_item(const WorkItem& w, Scratch& s, const T* query, int64_t q_tok_stride, int64_t q_head_stride,
              const C* k_cache, const C* v_cache, T* out, int64_t o_tok_stride, int64_t o_head_stride,
              const int64_t* tables, int64_t table_stride, const int64_t* qsl, const int64_t* ctx_lens,
              int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
              int64_t window, bool simd) {
#if defined(__AVX512F__)
  if (simd && block_size % 16 == 0) {
    if (head_dim == 64)
      return run_item_two_pass<4>(w, s, query, q_tok_stride, q_head_stride, k_cache, v_cache, out, o_tok_stride,
                                  o_head_stride, tables, table_stride, qsl, ctx_lens, group, num_kv_heads,
                                  block_size, scale, window);
    if (head_dim == 128)
      return run_item_two_pass<8>(w, s, query, q_tok_stride, q_head_stride, k_cache, v_cache, out, o_tok_stride,
                                  o_head_stride, tables, table_stride, qsl, ctx_lens, group, num_kv_heads,
                                  block_size, scale, window);
  }
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
  if (simd)
    return run_item_simd(w, s, query, q_tok_stride, q_head_stride, k_cache, v_cache, out, o_tok_stride,
                         o_head_stride, tables, table_stride, qsl, ctx_lens, group, num_kv_heads, head_dim,
                         block_size, scale, window);
#endif
  run_item_portable(w, s, query, q_tok_stride, q_head_stride, k_cache, v_cache, out, o_tok_stride, o_head_stride,
                    tables, table_stride, qsl, ctx_lens, group, num_kv_heads, head_dim, block_size, scale, window);
}

}  // namespace

// out[tokens, heads, head_dim] = causal attention of each sequence's new queries over its paged context.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k/v cache must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be the innermost, dense axis");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "out must have the query's dtype, and the v cache the k cache's");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k and v caches must have the same shape");
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [seqs, max_blocks]");
  const auto tables = block_tables.to(at::kLong).contiguous();
  const auto qsl = query_start_loc.to(at::kLong).contiguous();
  const auto ctx = context_lens.to(at::kLong).contiguous();
  const int64_t num_seqs = ctx.numel();
  TORCH_CHECK(qsl.numel() == num_seqs + 1 && tables.size(0) == num_seqs, "per-sequence tensors disagree");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(out.size(0) >= query.size(0) && out.size(1) == num_heads && out.size(2) == head_dim,
              "out must be at least query's shape");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t* qsl_p = qsl.data_ptr<int64_t>();
  const int64_t* ctx_p = ctx.data_ptr<int64_t>();
  const int64_t* tab_p = tables.data_ptr<int64_t>();

  // Bounds, once per sequence (defence in depth behind BatchMetadata's checks): every query
  // row, and every block id the context reads, inside its tensor, so a bad table raises here
  // instead of reading another sequence's KV or past the pool.
  TORCH_CHECK(num_seqs == 0 || (qsl_p[0] >= 0 && qsl_p[num_seqs] <= query.size(0)),
              "query_start_loc runs past the query's ", query.size(0), " tokens");
  const bool simd = vec::kHaveVec && head_dim % vec::kWidth == 0 && head_dim / vec::kWidth <= 16 &&
                    !std::getenv("PAGEDSERVE_PORTABLE_ATTENTION");
std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = qsl_p[i + 1] - qsl_p[i];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx_p[i], "sequence ", i, ": more new tokens than context");
    check_block_table(tab_p + i * tables.size(1), tables.size(1), ctx_p[i], block_size, num_blocks, i);
    for (int64_t t = 0; t < q_len; t += kQueryTile)
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({i, t, std::min(q_len, t + kQueryTile), h});
  }
  const int64_t max_rows = kQueryTile * group;
  // the cache may be stored in another dtype than the activations (--kv-cache-dtype)
  dispatch_float_types(query.scalar_type(), "paged_attention", [&](auto tag) {
  dispatch_float_types(k_cache.scalar_type(), "paged_attention cache", [&](auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    const scalar_t* q = query.data_ptr<scalar_t>();
    const cache_t* kc = k_cache.data_ptr<cache_t>();
    const cache_t* vc = v_cache.data_ptr<cache_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t n_items = static_cast<int64_t>(items.size());
    int64_t claimed = 0;  // items handed out
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items)))
    {
      Scratch s;
      s.q.resize(max_rows * head_dim);
      s.acc.resize(max_rows * head_dim);
      s.m.resize(max_rows);
      s.l.resize(max_rows);
      s.scores.resize(max_rows * block_size);
      s.k.resize(block_size * head_dim);  // keys, transposed
      s.v.resize(block_size * head_dim);
      // dynamic scheduling, one item claimed ahead so that the running one can fetch its blocks
      // Each thread claims a tile's KV heads together, where there are enough tiles to go round, and
      // runs them one after another: they read interleaved rows of the same blocks, which DRAM then
      // streams to one core instead of two (Xeon with AMX, decode from DRAM: 0.81x the time at 64
      // sequences x 200 tokens, 0.90x at 16 x 1,000, 0.90-0.97x at 2 x 4,000 to 8 x 1,000). With
      // fewer tiles than threads the heads go round one by one (1 x 8,000 grouped took 1.6x).
      const int64_t unit = n_items / num_kv_heads >= omp_get_num_threads() ? num_kv_heads : 1;
      int64_t i, next;
#pragma omp atomic capture
      i = claimed++;
      i *= unit;
      for (; i < n_items; i = next) {
        if ((i + 1) % unit != 0) {
          next = i + 1;
        } else {
#pragma omp atomic capture
          next = claimed++;
          next *= unit;
        }
        s.next = next < n_items ? &items[next] : nullptr;
        run_item(items[i], s, q, query.stride(0), query.stride(1), kc, vc, o, out.stride(0), out.stride(1), tab_p,
                 tables.size(1), qsl_p, ctx_p, group, num_kv_heads, head_dim, block_size, static_cast<float>(scale),
                 sliding_window, simd);
      }
    }
  });
  });
}

}  // namespace pagedserve
