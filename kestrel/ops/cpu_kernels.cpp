// Kestrel's CPU kernels, written once on the vector interface of vec_avx512.h / vec_avx2.h (a float
// vector of kLanes lanes) and compiled once per instruction set: with KESTREL_VEC_AVX512 (16 lanes,
// 32 registers, -march=native on an AVX-512 CPU) and with KESTREL_VEC_AVX2 (8 lanes, 16 registers,
// an AVX2 + FMA target); kestrel/ops/__init__.py picks the build for the CPU. Both builds export the
// same functions. float32 or bf16 storage, float32 math. Their PyTorch references live in
// kestrel/attention/ (kv_cache.py, torch_sdpa.py) and kestrel/ops/dispatch.py; tests/test_cpu_kernels.py
// compares (and tests/test_cpu_kernels_avx2_build.py runs those tests again on the AVX2 build).
//
// paged_decode_attention: one query token per sequence, grouped-query heads, read straight from the
// paged KV cache with no gathered copy (see "paged decode attention" below). The AVX-512 build reads
// a bf16 cache through its own block-major kernel with AMX scores (decode_bf16_avx512.h, the one
// part behind KESTREL_VEC_AVX512).
// paged_decode_attention_int8 and rotary_write_kv_int8: the int8 KV cache (int8_kv.h).
// rms_norm (optionally fused with the residual add), silu_and_mul, rotary_write_kv and argmax_rows:
// one pass over each row. linear_f32: float32 decode-sized products. linear_bf16: bf16 products of any
// size where there is no AVX512-BF16 (see "bf16 linear layers" below). DecodeLayers: the decode plan's
// layer loop, over the matmul the plan binds. linear_int8: --quantization int8's products where there is no AMX
// (AVX512-VNNI or AVX2; see "int8 linear layers" below). linear_gguf: products with a GGUF file's Q8_0,
// Q6_K, Q4_K, Q4_1 (Q4_0) and Q5_1, Q5_K (Q5_0) weights as the file stores them, or nearly (see "GGUF
// quantized weights" below).
#include "torch_api.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(KESTREL_VEC_AVX512)
#include "vec_avx512.h"
#include "decode_bf16_avx512.h"
#elif defined(KESTREL_VEC_AVX2)
#include "vec_avx2.h"
#else
#error "build with -DKESTREL_VEC_AVX512 or -DKESTREL_VEC_AVX2 (kestrel/ops/__init__.py does)"
#endif
#include "int8_kv.h"
#include "matmul_fn.h"
#include "parallel.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace kestrel_vec;
using kestrel_parallel::parallel_for_by_cost;

// Rows of the model dtype (float32 or bf16) as float32 vectors, and back (bf16 rounded to nearest
// even, as torch's .to(torch.bfloat16) rounds); round_to: a float32 result rounded as if stored.
inline VecF load_chunk(const float* p) { return load_f32(p); }
inline VecF load_chunk(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline void store_row_chunk(float* p, VecF v) { store(p, v); }
inline void store_row_chunk(c10::BFloat16* p, VecF v) { store_bf16(reinterpret_cast<uint16_t*>(p), v); }
inline VecF round_to(VecF v, float*) { return v; }
inline VecF round_to(VecF v, c10::BFloat16*) { return bf16_round_trip(v); }

// The (head_dim, query heads per KV head) pairs the attention kernels are built for: calls
// f(integral_constant D, integral_constant G) for the pair asked; false where there is none.
template <typename F>
bool with_head_shape(int64_t d, int64_t g, const F& f) {
#define KESTREL_CASE(D, G)                                                            \
  if (d == D && g == G) {                                                             \
    f(std::integral_constant<int, D>{}, std::integral_constant<int, G>{});            \
    return true;                                                                      \
  }
  KESTREL_CASE(64, 1) KESTREL_CASE(64, 2) KESTREL_CASE(64, 3) KESTREL_CASE(64, 4)
  KESTREL_CASE(64, 5) KESTREL_CASE(64, 8)
  KESTREL_CASE(128, 1) KESTREL_CASE(128, 2) KESTREL_CASE(128, 4) KESTREL_CASE(128, 8)
#undef KESTREL_CASE
  return false;
}

// ---- paged decode attention ----
//
// Work is cut into (sequence, KV head, segment) items, a segment being up to kSegmentTokens keys, so
// that a batch of one still spreads over the threads; each item reads its K and V rows once for all
// the G query heads that share them (scores, softmax, then the V rows, in registers), and the items
// of a sequence cut into segments are merged after the parallel loop (running max, sum of
// exponentials, unnormalised output).

constexpr int64_t kSegmentTokens = 256;  // keys per work item: a batch of one still fills the threads

template <int D, int G>
struct Partial {
  float m[G], l[G];
  float acc[G][D];  // unnormalised
};

// Query heads scored together: up to 3, so that their accumulators for 4 keys (12) and the 4 key
// vectors fit 16 registers; G is split evenly into such chunks.
template <int G>
constexpr int kHeadChunk = G % 3 == 0 ? 3 : (G % 2 == 0 ? 2 : 1);

// scores[j][i] = q_j . row_i for JC query heads and 4 keys. Summing 4 keys' products in one
// reduction instead of one reduction per key is what keeps the score loop on the FMA units.
template <typename T, int D, int JC>
inline void score_4_keys(const float* q, const T* const rows[4], __m128 out[JC]) {
  constexpr int C = D / kLanes;
  VecF acc[JC][4];
  for (int j = 0; j < JC; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = zero();
  for (int c = 0; c < C; ++c) {
    VecF kr[4];
    for (int i = 0; i < 4; ++i) kr[i] = load_chunk(rows[i] + c * kLanes);
    for (int j = 0; j < JC; ++j) {
      const VecF qv = load_f32(q + j * D + c * kLanes);
      for (int i = 0; i < 4; ++i) acc[j][i] = fma(qv, kr[i], acc[j][i]);
    }
  }
  for (int j = 0; j < JC; ++j) out[j] = hsum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
}

// Keys run in blocks of 16 tokens scattered over the pool, so the hardware prefetcher, which follows
// a stride, loses the stream at every block edge: measured (AVX2 build), 64 sequences' attention read
// the cache at 11 GB/s against a 28 GB/s streaming read. The score loop therefore prefetches the K
// and V rows kPrefetchKeys keys ahead (V is read by the P V pass right after, from L2).
constexpr int64_t kPrefetchKeys = 16;

template <typename T>
inline void prefetch_rows(const T* kp, const T* vp, const std::vector<int64_t>& rows, int64_t from, int64_t to,
                          size_t row_bytes) {
  for (int64_t t = from; t < to; ++t)
    for (size_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kp + rows[t]) + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vp + rows[t]) + b, _MM_HINT_T1);
    }
}

// The K and V rows of the item a thread takes next, fetched into L2 while it computes this one: its
// K rows during this item's score loop, its V rows during the P V loop. The in-item prefetch alone
// left the memory idle through softmax and P V, so an item took the sum of its compute and its
// reads (measured, AVX2 build on 2 Zen 3 cores, 64 sequences of 330 keys in scattered blocks: 3.3 ms
// a layer; 2.6 with this).
template <typename T, int D>
struct NextItem {
  const T* k = nullptr;  // the item's KV head in the K and V caches
  const T* v = nullptr;
  const int64_t* rows = nullptr;
  int64_t n = 0;  // 0: no next item on this thread

  // Callers test the bounds themselves: GCC 12 dropped the prefetch from the P V loop when the test
  // sat in a member function here (found in the disassembly; the score loop's call had survived).
  static void prefetch_row(const T* row) {
    const char* p = reinterpret_cast<const char*>(row);
    [&]<size_t... L>(std::index_sequence<L...>) {
      (_mm_prefetch(p + 64 * L, _MM_HINT_T1), ...);
    }(std::make_index_sequence<(D * sizeof(T) + 63) / 64>{});
  }
};

// Item (s, h, segment [t0, t1)) → its partial result. q rows float32, pre-scaled by the caller;
// `rows` holds the segment's cache row offsets (token slot × stride).
template <typename T, int D, int G>
void attend_segment(const float* q, const T* kp, const T* vp, const std::vector<int64_t>& rows, int64_t n,
                    std::vector<float>& scores, Partial<D, G>& out, const NextItem<T, D>& next) {
  constexpr int C = D / kLanes, JC = kHeadChunk<G>, CC = C < 4 ? C : 4;
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(G * padded);
  for (int j0 = 0; j0 < G; j0 += JC) {
    __m128 mx4[JC];
    for (int j = 0; j < JC; ++j) mx4[j] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      if (j0 == 0) {
        prefetch_rows(kp, vp, rows, t + kPrefetchKeys, std::min(n, t + kPrefetchKeys + 4), D * sizeof(T));
        for (int64_t u = t; u < std::min(next.n, t + 4); ++u) next.prefetch_row(next.k + next.rows[u]);
      }
      const T* const keys[4] = {kp + rows[t], kp + rows[t + 1], kp + rows[t + 2], kp + rows[t + 3]};
      __m128 sc[JC];
      score_4_keys<T, D, JC>(q + j0 * D, keys, sc);
      for (int j = 0; j < JC; ++j) {
        _mm_storeu_ps(scores.data() + (j0 + j) * padded + t, sc[j]);
        mx4[j] = _mm_max_ps(mx4[j], sc[j]);
      }
    }
    for (int j = 0; j < JC; ++j) {
      alignas(16) float m4[4];
      _mm_store_ps(m4, mx4[j]);
      float mx = std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
      for (int64_t u = t; u < n; ++u) {  // the last 0-3 keys, one at a time
        const T* row = kp + rows[u];
        VecF acc = mul(load_f32(q + (j0 + j) * D), load_chunk(row));
        for (int c = 1; c < C; ++c) acc = fma(load_f32(q + (j0 + j) * D + c * kLanes), load_chunk(row + c * kLanes), acc);
        const float sc = hsum(acc);
        scores[(j0 + j) * padded + u] = sc;
        mx = std::max(mx, sc);
      }
      out.m[j0 + j] = mx;
    }
  }
  for (int j = 0; j < G; ++j) {
    float* sj = scores.data() + j * padded;
    const VecF m = splat(out.m[j]);
    VecF sum = zero();
    for (int64_t i = 0; i < padded; i += kLanes) {
      // Lanes past the segment's end are zeroed: they hold no score.
      const VecF e = keep(lanes_below(n - i), exp_clamped(sub(load_f32(sj + i), m)));
      store(sj + i, e);
      sum = add(sum, e);
    }
    out.l[j] = hsum(sum);
  }
  // P V in register blocks of JC heads × CC vectors of the head dimension (at most 12 accumulators):
  // each pass reads its own part of every V row, so V still comes from memory once.
  for (int j0 = 0; j0 < G; j0 += JC)
    for (int c0 = 0; c0 < C; c0 += CC) {
      VecF acc[JC][CC];
      for (int j = 0; j < JC; ++j)
        for (int c = 0; c < CC; ++c) acc[j][c] = zero();
      for (int64_t t = 0; t < n; ++t) {
        const T* row = vp + rows[t] + c0 * kLanes;
        if (j0 == 0 && c0 == 0 && t < next.n) next.prefetch_row(next.v + next.rows[t]);
        VecF p[JC];
        for (int j = 0; j < JC; ++j) p[j] = splat(scores[(j0 + j) * padded + t]);
        for (int c = 0; c < CC; ++c) {
          const VecF v = load_chunk(row + c * kLanes);
          for (int j = 0; j < JC; ++j) acc[j][c] = fma(p[j], v, acc[j][c]);
        }
      }
      for (int j = 0; j < JC; ++j)
        for (int c = 0; c < CC; ++c) store(out.acc[j0 + j] + (c0 + c) * kLanes, acc[j][c]);
    }
}

template <typename T, int D, int G>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
         int64_t block_size, float scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), stride = kv_heads * D;
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // Items in (sequence, segment, KV head) order; first_item[s] is sequence s's first.
  std::vector<int64_t> first_item(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t segments = lens[s] > 0 ? (lens[s] + kSegmentTokens - 1) / kSegmentTokens : 0;
    first_item[s + 1] = first_item[s] + segments * kv_heads;
    if (lens[s] <= 0) std::memset(op + s * num_heads * D, 0, sizeof(float) * num_heads * D);
  }
  const int64_t total = first_item[num_seqs];
  std::vector<Partial<D, G>> parts(total);
  // An item's sequence, KV head and keys (their cache row offsets into `rows`).
  struct Segment {
    int64_t s, h, n;
  };
  auto segment_rows = [&](int64_t item, int64_t s, std::vector<int64_t>& rows) {
    while (item >= first_item[s + 1]) ++s;
    const int64_t local = item - first_item[s], seg = local / kv_heads;
    const int64_t t0 = seg * kSegmentTokens, t1 = std::min(lens[s], t0 + kSegmentTokens);
    const int64_t* table = tables + s * max_blocks;
    // Row offsets walk the block table without a division per key (one costs ~10 ns here).
    for (int64_t t = t0, b = t0 / block_size, off = t0 % block_size; t < t1; ++t) {
      rows[t - t0] = (table[b] * block_size + off) * stride;
      if (++off == block_size) off = 0, ++b;
    }
    return Segment{s, local % kv_heads, t1 - t0};
  };
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> rows(kSegmentTokens), next_rows(kSegmentTokens);
    alignas(64) float qs[G * D];
    const int64_t first_s = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    Segment cur = segment_rows(begin, first_s, rows);
    for (int64_t item = begin; item < end; ++item) {
      const Segment nxt = item + 1 < end ? segment_rows(item + 1, cur.s, next_rows) : Segment{cur.s, 0, 0};
      const float* qrow = qp + (cur.s * num_heads + cur.h * G) * D;
      for (int i = 0; i < G * D; i += kLanes) store(qs + i, mul(load_f32(qrow + i), splat(scale)));
      const NextItem<T, D> next{kp + nxt.h * D, vp + nxt.h * D, next_rows.data(), nxt.n};
      attend_segment<T, D, G>(qs, kp + cur.h * D, vp + cur.h * D, rows, cur.n, scores, parts[item], next);
      std::swap(rows, next_rows);
      cur = nxt;
    }
  });
  // Merge each (sequence, KV head)'s segments: rescale to the largest running max, sum, normalise.
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t s = pair / kv_heads, h = pair % kv_heads;
      const int64_t segments = (first_item[s + 1] - first_item[s]) / kv_heads;
      if (segments == 0) continue;
      for (int j = 0; j < G; ++j) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t g = 0; g < segments; ++g) mx = std::max(mx, parts[first_item[s] + g * kv_heads + h].m[j]);
        float sum = 0.f;
        VecF acc[D / kLanes];
        for (int c = 0; c < D / kLanes; ++c) acc[c] = zero();
        for (int64_t g = 0; g < segments; ++g) {
          const Partial<D, G>& p = parts[first_item[s] + g * kv_heads + h];
          const float w = std::exp(p.m[j] - mx);
          sum += p.l[j] * w;
          for (int c = 0; c < D / kLanes; ++c) acc[c] = fma(splat(w), load_f32(p.acc[j] + c * kLanes), acc[c]);
        }
        float* dst = op + (s * num_heads + h * G + j) * D;
        for (int c = 0; c < D / kLanes; ++c) store(dst + c * kLanes, mul(acc[c], splat(1.f / sum)));
      }
    }
  });
}

// A decode kernel's float32 result, rounded once to `dtype` (bf16, round to nearest even, as .to()
// rounds) or returned as is. Here, not through .to(): on so small a tensor .to() costs ~10 µs of
// dispatch, 30 times a decode step.
at::Tensor in_dtype(const at::Tensor& out, c10::ScalarType dtype) {
  if (dtype == at::kFloat) return out;
  TORCH_CHECK(dtype == at::kBFloat16, "q must be float32 or bfloat16");
  auto rounded = at::empty(out.sizes(), out.options().dtype(at::kBFloat16));
  const float* src = out.data_ptr<float>();
  c10::BFloat16* dst = rounded.data_ptr<c10::BFloat16>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) dst[i] = c10::BFloat16(src[i]);
  return rounded;
}

// Where the bf16 cache goes to the AVX-512 build's own kernel: AMX scores need q exactly in bf16 (it
// is, in a bf16 model) and whole 16-row tiles in memory; the AVX-512 scores take the rest.
bool bf16_decode(at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                 int64_t block_size, float scale) {
#if defined(KESTREL_VEC_AVX512)
  namespace bd = kestrel_bf16_decode;
  if (k_cache.scalar_type() != at::kBFloat16) return false;
  bool amx = false;
#ifdef KESTREL_AMX
  amx = q.scalar_type() == at::kBFloat16 && block_size % 16 == 0 && bd::amx_usable();
#endif
  bool dot = false;
#ifdef KESTREL_BF16_DOT
  dot = !amx && q.scalar_type() == at::kBFloat16;
#endif
  q = amx || dot ? q.contiguous() : q.to(at::kFloat).contiguous();
  return with_head_shape(q.size(2), q.size(1) / k_cache.size(1), [&](auto d, auto g) {
    constexpr int D = decltype(d)::value, G = decltype(g)::value;
    if (amx) bd::run_bf16<D, G, true, false>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, scale);
#ifdef KESTREL_BF16_DOT
    else if (dot) bd::run_bf16<D, G, false, true>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, scale);
#endif
    else bd::run_bf16<D, G, false, false>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, scale);
  });
#else
  return false;
#endif
}

}  // namespace

// q [num_seqs, num_heads, head_dim] float32 or bfloat16; k_cache, v_cache [num_slots, kv_heads, head_dim] float32 or
// bfloat16; block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs] int64 (keys 0..len-1 visible).
// Returns [num_seqs, num_heads, head_dim]: float32, or with `in_q_dtype` q's dtype (see in_dtype).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens,
                                  int64_t block_size, double scale, bool in_q_dtype) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == at::kFloat, "the KV cache must be float32 or bfloat16");
  const auto q_dtype = q.scalar_type();
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  const float sc = static_cast<float>(scale);
  const int64_t d = q.size(2), g = q.size(1) / k_cache.size(1);
  const bool done = bf16_decode(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc) ||
                    with_head_shape(d, g, [&](auto dd, auto gg) {
    constexpr int D = decltype(dd)::value, G = decltype(gg)::value;
    q = q.to(at::kFloat).contiguous();
    if (bf16) run<c10::BFloat16, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc);
    else run<float, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc);
  });
  TORCH_CHECK(done, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return in_q_dtype ? in_dtype(out, q_dtype) : out;
}

bool supports(int64_t head_dim, int64_t group) {
  return with_head_shape(head_dim, group, [](auto, auto) {});
}

// ---- elementwise kernels for the layer: RMSNorm (with the residual add fused) and SiLU-and-mul ----

namespace {

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.defined() ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      VecF ss = zero();
      for (int64_t i = 0; i < hidden; i += kLanes) {
        VecF v = load_chunk(xp + r * hidden + i);
        if (rp != nullptr) {
          // residual += x, rounded to the model dtype as an unfused add would be; normalise that.
          store_row_chunk(rp + r * hidden + i, add(v, load_chunk(rp + r * hidden + i)));
          v = load_chunk(rp + r * hidden + i);
        }
        store(row.data() + i, v);
        ss = fma(v, v, ss);
      }
      const VecF scale = splat(1.f / std::sqrt(hsum(ss) / hidden + static_cast<float>(eps)));
      for (int64_t i = 0; i < hidden; i += kLanes)
        store_row_chunk(op + r * hidden + i, mul(mul(load_f32(row.data() + i), scale), load_chunk(wp + i)));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * d;
      const T* up = gate + d;
      for (int64_t i = 0; i < d; i += kLanes) {
        const VecF g = load_chunk(gate + i);
        const VecF silu = div(g, add(splat(1.f), exp_clamped(sub(zero(), g))));
        store_row_chunk(op + r * d + i, mul(silu, load_chunk(up + i)));
      }
    }
  });
}

// f<T>() for the dtype of a float32 or bfloat16 tensor; `what` names the kernel in the error.
template <typename F>
void with_float_dtype(c10::ScalarType dtype, const char* what, const F& f) {
  if (dtype == at::kBFloat16) f(c10::BFloat16{});
  else if (dtype == at::kFloat) f(float{});
  else TORCH_CHECK(false, what, ": float32 or bfloat16 only");
}

}  // namespace

// out = rms_norm(x) * weight, or with `residual` given: residual += x, out = rms_norm(residual) * weight.
// x, residual, out [rows, hidden] contiguous, hidden % kLanes == 0; float32 or bfloat16, all one dtype.
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kLanes == 0, "rms_norm: bad input");
  at::Tensor res = residual.has_value() ? residual.value() : at::Tensor();
  if (res.defined()) TORCH_CHECK(res.is_contiguous() && res.sizes() == x.sizes(), "rms_norm: bad residual");
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  with_float_dtype(x.scalar_type(), "rms_norm", [&](auto t) { rms_norm_impl<decltype(t)>(x, res, weight, out, eps); });
  return out;
}

// x [rows, 2 d] = gate | up → silu(gate) * up [rows, d]; d % kLanes == 0.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % (2 * kLanes) == 0, "silu_and_mul: bad input");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  with_float_dtype(x.scalar_type(), "silu_and_mul", [&](auto t) { silu_and_mul_impl<decltype(t)>(x, out); });
  return out;
}

// ---- rotary embedding fused with the KV-cache write ----

namespace {

template <typename T>
void rotate_row(T* x, const T* cos, const T* sin, int64_t half) {
  T* tag = nullptr;
  for (int64_t i = 0; i < half; i += kLanes) {
    const VecF lo = load_chunk(x + i), hi = load_chunk(x + half + i);
    // rotate_half(x) = (-hi, lo)
    const VecF new_lo = add_exact(round_to(mul_exact(lo, load_chunk(cos + i)), tag),
                                  round_to(mul_exact(negate(hi), load_chunk(sin + i)), tag));
    const VecF new_hi = add_exact(round_to(mul_exact(hi, load_chunk(cos + half + i)), tag),
                                  round_to(mul_exact(lo, load_chunk(sin + half + i)), tag));
    store_row_chunk(x + i, new_lo);
    store_row_chunk(x + half + i, new_hi);
  }
}

// Rotates the q and k heads of every token of qkv in place, then hands the token's row to
// write(t, row) (the cache write, in whichever layout), in parallel over tokens.
template <typename T, typename Write>
void rotate_tokens(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                   int64_t grain, const Write& write) {
  const int64_t n = qkv.size(0), all_heads = qkv.size(1), d = qkv.size(2);
  const int64_t rotated = num_heads + (all_heads - num_heads) / 2, half = d / 2;
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = xp + t * all_heads * d;
      for (int64_t h = 0; h < rotated; ++h) rotate_row(row + h * d, cp + t * d, sp + t * d, half);
      write(t, row);
    }
  });
}

template <typename T>
void rotary_write_kv_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                          int64_t num_heads) {
  const int64_t d = qkv.size(2), kv_heads = (qkv.size(1) - num_heads) / 2, kv_row = kv_heads * d;
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const int64_t* slot = slots.defined() ? slots.data_ptr<int64_t>() : nullptr;
  rotate_tokens<T>(qkv, cos, sin, num_heads, 64, [&](int64_t t, const T* row) {
    if (slot == nullptr) return;
    std::memcpy(kp + slot[t] * kv_row, row + num_heads * d, kv_row * sizeof(T));
    std::memcpy(vp + slot[t] * kv_row, row + (num_heads + kv_heads) * d, kv_row * sizeof(T));
  });
}

}  // namespace

// qkv [tokens, num_heads + 2 kv_heads, head_dim] contiguous: rotates the q and k heads in place
// (Hugging Face's rotate_half layout; cos, sin [tokens, head_dim] in qkv's dtype) and, with
// slot_mapping given, writes each token's k and v heads to slot_mapping[t] of the
// [num_slots, kv_heads, head_dim] caches. head_dim % (2 kLanes) == 0; float32 or bfloat16, one dtype.
void rotary_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                     at::Tensor v_cache, c10::optional<at::Tensor> slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(2) % (2 * kLanes) == 0, "rotary_write_kv: bad qkv");
  TORCH_CHECK((qkv.size(1) - num_heads) % 2 == 0 && qkv.size(1) > num_heads, "rotary_write_kv: bad head count");
  cos = cos.reshape({qkv.size(0), qkv.size(2)}).contiguous();
  sin = sin.reshape({qkv.size(0), qkv.size(2)}).contiguous();
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rotary_write_kv: dtypes differ");
  at::Tensor slots;
  if (slot_mapping.has_value()) {
    slots = slot_mapping.value().to(at::kLong).contiguous();
    const int64_t kv_heads = (qkv.size(1) - num_heads) / 2;
    TORCH_CHECK(slots.numel() == qkv.size(0), "rotary_write_kv: one slot per token");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                k_cache.size(1) == kv_heads && k_cache.size(2) == qkv.size(2) &&
                k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == qkv.scalar_type() &&
                v_cache.scalar_type() == qkv.scalar_type(), "rotary_write_kv: bad cache");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < slots.numel(); ++t)
      TORCH_CHECK(sp[t] >= 0 && sp[t] < k_cache.size(0), "rotary_write_kv: slot out of range");
  }
  with_float_dtype(qkv.scalar_type(), "rotary_write_kv", [&](auto t) {
    rotary_write_kv_impl<decltype(t)>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  });
}

// ---- int8 KV cache (--kv-cache-dtype int8) ----
//
// Each (token, KV head) row of head_dim values is stored as int8 with one float32 scale:
// x ≈ q * scale, scale = max|x| / 127, q = round-half-even(x / scale) (0 and scale 0 for a zero row).
// K is transposed within each block of 16 tokens, so that a block's 16 scores come out of 16 / kLanes
// vectors per dimension; the layout, the argument checks and a decode item's order of reading are in
// int8_kv.h. The PyTorch reference is in kestrel/attention/kv_cache.py (write_kv, gather_kv).

namespace {

constexpr int64_t kInt8Block = kestrel_int8_kv::kBlock;
constexpr int kHalves = kInt8Block / kLanes;  // vectors per block of 16 scores
static_assert(kInt8Block % kLanes == 0, "whole vectors per block");

// Quantize one row of d floats (d % kLanes == 0); returns the scale. Bit for bit the same in both builds.
inline float quantize_row(const float* x, int64_t d, int8_t* q, int64_t q_stride) {
  VecF amax = zero();
  for (int64_t i = 0; i < d; i += kLanes) amax = max(amax, abs(load_f32(x + i)));
  const float m = hmax(amax);
  if (m == 0.f) {
    for (int64_t i = 0; i < d; ++i) q[i * q_stride] = 0;
    return 0.f;
  }
  const float scale = m / 127.f;
  const VecF sv = splat(scale);
  alignas(64) int32_t qi[kLanes];
  for (int64_t i = 0; i < d; i += kLanes) {
    // true division, then round half to even (the default rounding mode), as torch.round(x / scale)
    store_rounded(qi, div(load_f32(x + i), sv));
    for (int j = 0; j < kLanes; ++j) q[(i + j) * q_stride] = static_cast<int8_t>(qi[j]);
  }
  return scale;
}

template <typename T>
void rotary_write_kv_int8_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_t, at::Tensor& k_scale, at::Tensor& v, at::Tensor& v_scale,
                               const at::Tensor& slots, int64_t num_heads) {
  const int64_t d = qkv.size(2), kv_heads = (qkv.size(1) - num_heads) / 2;
  int8_t* ktp = k_t.data_ptr<int8_t>();
  float* ksp = k_scale.data_ptr<float>();
  int8_t* vp = v.data_ptr<int8_t>();
  float* vsp = v_scale.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  rotate_tokens<T>(qkv, cos, sin, num_heads, 16, [&](int64_t t, const T* row) {
    float row_f[256];  // head_dim <= 256
    const auto to_float = [&](const T* x) {
      for (int64_t i = 0; i < d; i += kLanes) store(row_f + i, load_chunk(x + i));
    };
    const int64_t blk = slot[t] / kInt8Block, off = slot[t] % kInt8Block;
    for (int64_t h = 0; h < kv_heads; ++h) {
      to_float(row + (num_heads + h) * d);
      ksp[(blk * kv_heads + h) * kInt8Block + off] =
          quantize_row(row_f, d, ktp + (blk * kv_heads + h) * d * kInt8Block + off, kInt8Block);
      to_float(row + (num_heads + kv_heads + h) * d);
      vsp[slot[t] * kv_heads + h] = quantize_row(row_f, d, vp + (slot[t] * kv_heads + h) * d, 1);
    }
  });
}

// Decode attention over the int8 cache: one (sequence, KV head) per work item, items to threads by
// cost (parallel_for_by_cost); the scores of a block's 16 keys (kHalves vectors) from the transposed
// K, kInt8HeadChunk<G> query heads at a time, each with kInt8Partials<G> partial sums, so that many
// FMA chains are in flight rather than one per head waiting on the latency of the one before; a
// softmax over each head's scores, each exponential stored times its V row's scale; then the V rows
// weighted, kInt8VChunk<G, C> vectors of dimensions at a time (the item's V rows, read again for
// each, are in L2 by then). While a block (K or V) is computed, the block kInt8PrefetchUnits ahead
// in the item's order of reading (K blocks, then V blocks, then the next item's) is prefetched a
// line at a time, spread over the computation rather than in a burst.
// The chunks are sized by the registers: 32 (AVX-512) hold every head's 4 partial sums and a whole
// V row per head; 16 (AVX2) take heads 3 or 4 at a time. Measured on W1-like batches (52 sequences
// of 100-700 tokens, 2 cores with AMX, 2026-12-01, AVX-512): 1.5x the kernel with one chain per head,
// equal-count threads and a burst one block ahead; 5 blocks ahead was 1.06x over 2 and 1.01x over 3.
template <int G>
constexpr int kInt8HeadChunk = kRegisters >= 32 ? G : (G % 3 == 0 ? 3 : (G % 4 == 0 ? 4 : (G % 2 == 0 ? 2 : 1)));
template <int G>
constexpr int kInt8Partials = kRegisters >= 32 ? 4 : (2 * kInt8HeadChunk<G> >= 8 ? 1 : 2);
template <int G, int C>
constexpr int kInt8VChunk = kRegisters >= 32 ? C : (G <= 2 ? 4 : (G <= 5 ? 2 : 1));
constexpr int64_t kInt8PrefetchUnits = 5;

template <int D, int G>
void run_int8(const at::Tensor& q, const at::Tensor& k_t, const at::Tensor& k_scale,
              const at::Tensor& v, const at::Tensor& v_scale, const at::Tensor& block_tables,
              const at::Tensor& seq_lens, at::Tensor& out, float scale) {
  constexpr int C = D / kLanes, JC = kInt8HeadChunk<G>, P = kInt8Partials<G>, VC = kInt8VChunk<G, C>;
  static_assert(C % VC == 0 && G % JC == 0 && 4 % P == 0, "whole chunks of heads and of dimensions");
  constexpr int64_t BS = kInt8Block;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = v.size(1);
  const int64_t max_blocks = block_tables.size(1);
  const float* qf = q.data_ptr<float>();
  const int8_t* ktp = k_t.data_ptr<int8_t>();
  const float* ksp = k_scale.data_ptr<float>();
  const int8_t* vp = v.data_ptr<int8_t>();
  const float* vsp = v_scale.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t items = num_seqs * kv_heads;
  const kestrel_int8_kv::ReadOrder<D> order{ktp, vp, tables, lens, kv_heads, max_blocks, items};
  using Rows = typename kestrel_int8_kv::ReadOrder<D>::Rows;

  auto one_item = [&](int64_t item, std::vector<float>& scores, std::vector<float>& vscales) {
    const int64_t s = item / kv_heads, h = item % kv_heads, len = lens[s];
    float* dst = op + (s * num_heads + h * G) * D;
    if (len <= 0) {
      std::memset(dst, 0, sizeof(float) * G * D);
      return;
    }
    const int64_t* table = tables + s * max_blocks;
    const int64_t nb = (len + BS - 1) / BS, span = nb * BS;
    alignas(64) float qs[D][G];  // scaled q by dimension: a dimension's G broadcasts side by side
    for (int j = 0; j < G; ++j)
      for (int dd = 0; dd < D; ++dd) qs[dd][j] = qf[(s * num_heads + h * G + j) * D + dd] * scale;
    scores.resize(G * span);
    vscales.resize(span);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = table[b];
      const int8_t* kb = ktp + (blk * kv_heads + h) * D * BS;
      const Rows ahead = order.unit(item, b + kInt8PrefetchUnits);
      const int64_t n = std::min<int64_t>(BS, len - b * BS);
      for (int j0 = 0; j0 < G; j0 += JC) {
        VecF acc[JC][kHalves][P];
        for (int j = 0; j < JC; ++j)
          for (int half = 0; half < kHalves; ++half)
            for (int p = 0; p < P; ++p) acc[j][half][p] = zero();
        for (int dd = 0; dd < D; dd += 4) {
          if (j0 == 0) ahead.prefetch(dd / 4);  // D / 4 lines: the unit's 16 * D / 64
          for (int i = 0; i < 4; ++i) {
            VecF kd[kHalves];
            for (int half = 0; half < kHalves; ++half) kd[half] = load_int8(kb + (dd + i) * BS + half * kLanes);
            for (int j = 0; j < JC; ++j) {
              const VecF qv = splat(qs[dd + i][j0 + j]);
              for (int half = 0; half < kHalves; ++half) acc[j][half][i % P] = fma(qv, kd[half], acc[j][half][i % P]);
            }
          }
        }
        for (int j = 0; j < JC; ++j)
          for (int half = 0; half < kHalves; ++half) {
            VecF sum = acc[j][half][0];
            for (int p = 1; p < P; ++p) sum = add(sum, acc[j][half][p]);
            const VecF sk = load_f32(ksp + (blk * kv_heads + h) * BS + half * kLanes);
            store(scores.data() + (j0 + j) * span + b * BS + half * kLanes,
                  select(lanes_below(n - half * kLanes), mul(sum, sk), splat(neg_inf)));
          }
      }
      // The block's V row scales, in the order of the scores (16 at a stride of kv_heads).
      for (int half = 0; half < kHalves; ++half)
        store(vscales.data() + b * BS + half * kLanes,
              gather_strided(vsp + (blk * BS + half * kLanes) * kv_heads + h, kv_heads));
    }
    // Each score becomes its exponential times its V row's scale; the sum is of the exponentials.
    float inv[G];
    for (int j = 0; j < G; ++j) {
      float* sj = scores.data() + j * span;
      VecF mv = splat(neg_inf);
      for (int64_t t = 0; t < span; t += kLanes) mv = max(mv, load_f32(sj + t));
      const VecF m = splat(hmax(mv));
      VecF sum = zero();
      for (int64_t t = 0; t < span; t += kLanes) {
        const VecF e = keep(lanes_below(len - t), exp_clamped(sub(load_f32(sj + t), m)));
        store(sj + t, mul(e, load_f32(vscales.data() + t)));
        sum = add(sum, e);
      }
      inv[j] = 1.f / hsum(sum);
    }
    for (int c0 = 0; c0 < C; c0 += VC) {
      VecF acc[G][VC];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < VC; ++c) acc[j][c] = zero();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t base = table[b] * BS, n = std::min<int64_t>(BS, len - b * BS);
        const Rows ahead = c0 == 0 ? order.unit(item, nb + b + kInt8PrefetchUnits) : Rows{};
        const float* pb = scores.data() + b * BS;
        for (int64_t o = 0; o < n; ++o) {
          for (int i = 0; i < D / 64; ++i) ahead.prefetch(o * (D / 64) + i);
          const int8_t* row = vp + ((base + o) * kv_heads + h) * D + c0 * kLanes;
          VecF vr[VC];
          for (int c = 0; c < VC; ++c) vr[c] = load_int8(row + c * kLanes);
          for (int j = 0; j < G; ++j) {
            const VecF p = splat(pb[j * span + o]);
            for (int c = 0; c < VC; ++c) acc[j][c] = fma(p, vr[c], acc[j][c]);
          }
        }
      }
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < VC; ++c) store(dst + j * D + (c0 + c) * kLanes, mul(acc[j][c], splat(inv[j])));
    }
  };

  parallel_for_by_cost(items, [&](int64_t item) { return 1 + order.blocks_of(item); }, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, vscales;
    for (int64_t item = begin; item < end; ++item) one_item(item, scores, vscales);
  });
}

}  // namespace

// rotary_write_kv for the int8 cache: rotates q and k in place and writes k, v quantized.
void rotary_write_kv_int8(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_t,
                          at::Tensor k_scale, at::Tensor v, at::Tensor v_scale, at::Tensor slot_mapping,
                          int64_t num_heads) {
  const auto slots = kestrel_int8_kv::checked_write_args(qkv, cos, sin, k_t, k_scale, v, v_scale, slot_mapping,
                                                        num_heads, kLanes);
  with_float_dtype(qkv.scalar_type(), "rotary_write_kv_int8", [&](auto t) {
    rotary_write_kv_int8_impl<decltype(t)>(qkv, cos, sin, k_t, k_scale, v, v_scale, slots, num_heads);
  });
}

// Decode attention over the int8 cache (layout above; block_size 16). Returns float32, or with
// `in_q_dtype` q's dtype.
at::Tensor paged_decode_attention_int8(at::Tensor q, at::Tensor k_t, at::Tensor k_scale, at::Tensor v,
                                       at::Tensor v_scale, at::Tensor block_tables, at::Tensor seq_lens,
                                       int64_t block_size, double scale, bool in_q_dtype) {
  kestrel_int8_kv::check_decode_args(q, k_t, k_scale, v, v_scale, block_size);
  const auto out_dtype = q.scalar_type();
  auto qf = q.to(at::kFloat).contiguous();
  auto out = at::empty(qf.sizes(), qf.options());
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  const int64_t d = q.size(2), g = q.size(1) / v.size(1);
  const float sc = static_cast<float>(scale);
  const bool done = with_head_shape(d, g, [&](auto dd, auto gg) {
    run_int8<decltype(dd)::value, decltype(gg)::value>(qf, k_t, k_scale, v, v_scale, block_tables, seq_lens, out, sc);
  });
  TORCH_CHECK(done, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return in_q_dtype ? in_dtype(out, out_dtype) : out;
}

// ---- argmax over the rows of float32 logits ----

namespace {

// The first index of the row's maximum, NaN counting as above everything (torch.argmax's rule).
int64_t argmax_row(const float* x, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  VecI idx = iota(), best_i = idx;
  VecF best = splat(-std::numeric_limits<float>::infinity());
  Mask nan = lanes_below(0);
  for (int64_t i = 0; i < full; i += kLanes) {
    const VecF v = load_f32(x + i);
    nan = either(nan, is_nan(v));
    const Mask gt = greater(v, best);  // strictly: each lane keeps its first
    best = select(gt, v, best);
    best_i = select_i(gt, idx, best_i);
    idx = add_i(idx, kLanes);
  }
  if (any(nan))
    for (int64_t i = 0; i < full; ++i)
      if (std::isnan(x[i])) return i;
  alignas(64) float bv[kLanes];
  alignas(64) int32_t bi[kLanes];
  store(bv, best);
  store_i(bi, best_i);
  // Among the lanes holding the maximum, the smallest index (lanes only ever hold -inf or values
  // seen; an all -inf row, or a row shorter than a vector, has index 0 in lane 0).
  float m = bv[0];
  int64_t at = bi[0];
  for (int l = 1; l < kLanes; ++l)
    if (bv[l] > m || (bv[l] == m && bi[l] < at)) m = bv[l], at = bi[l];
  for (int64_t i = full; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > m) m = x[i], at = i;
  }
  return at;
}

}  // namespace

// x [rows, n] float32 contiguous (n < 2^31) → int64 [rows]: torch.argmax(x, dim=-1).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0 &&
              x.size(1) < (int64_t(1) << 31), "argmax_rows: float32 [rows, n] contiguous");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// ---- float32 linear layers for decode-sized batches ----
//
// linear_f32(x [M, K], w [N, K]) -> y [M, N] = x w^T, float32, K % 8 == 0 (a last part of K shorter
// than a vector is read through a lane mask). The library GEMM reaches 15-110 GFLOP/s on an AVX2
// machine at 1-64 rows (and under 50 on the output head at 1-32), against ~130-170 at prefill
// sizes. Here a tile of 4 rows of x by 3 rows of w keeps 12 accumulators in registers (with the 3 w
// vectors and one x vector, all 16 AVX2 registers), each summed across its lanes at the end. Threads
// take tiles of 3 weight rows; each keeps its 3 rows in L1 while it walks every 4-row block of x,
// and K is cut into pieces of at most kMaxKPiece so that the block of x being walked stays in L2
// (512 KB) at 64-128 rows.

namespace {

constexpr int64_t kMaxKPiece = 768;
constexpr int64_t kMaxStreamRows = 4;  // up to here, gemv_rows; beyond, the register tiles

// Lanes [k, k + kLanes) of a row, or its last k1 - k < kLanes values and zeros.
inline VecF load_part(const float* row, int64_t k, int64_t k1) {
  return k + kLanes <= k1 ? load_f32(row + k) : load_first(row + k, k1 - k);
}

// y[m, n] (+)= x[m, k0:k1] . w[n, k0:k1] for MR rows of x from `x` (rows xK apart) and NR rows of w
// from `w` (rows wK apart); with `next` given, the same part of the next NR rows of w is prefetched
// along the way (the weights stream from memory, and the hardware prefetcher alone leaves much of its
// latency exposed). Each output is its lanes summed in k order, then across the lanes (hsum), then
// added to y: the same sum for any MR and NR.
template <int MR, int NR>
inline void linear_tile(const float* x, int64_t xK, const float* w, int64_t wK, int64_t k0, int64_t k1, float* y,
                        int64_t N, bool accumulate, const float* next) {
  VecF acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = zero();
  const auto step = [&](int64_t k, const auto& load) {
    if (next != nullptr && k % 16 < kLanes)  // a line of each next row per 16 floats
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(next + n * wK + k), _MM_HINT_T0);
    VecF wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load(w + n * wK + k);
    for (int m = 0; m < MR; ++m) {
      const VecF xv = load(x + m * xK + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = fma(xv, wv[n], acc[m][n]);
    }
  };
  int64_t k = k0;
  for (; k + kLanes <= k1; k += kLanes) step(k, [](const float* p) { return in_register(load_f32(p)); });
  if (k < k1) step(k, [n = k1 - k](const float* p) { return load_first(p, n); });
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * N + n] = (accumulate ? y[m * N + n] : 0.f) + hsum(acc[m][n]);
}

// The first row block of x prefetches the next tile's weights (`next`, nullptr at the end).
template <int NR>
void linear_rows(const float* x, const float* w, int64_t M, int64_t K, int64_t k0, int64_t k1, int64_t n0,
                 float* y, int64_t N, const float* next) {
  const bool acc = k0 > 0;
  const float* wn = w + n0 * K;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4, next = nullptr) linear_tile<4, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next);
  switch (M - m) {
    case 3: linear_tile<3, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    case 2: linear_tile<2, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    case 1: linear_tile<1, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    default: break;
  }
}

// Weights as float32 vectors: float32 as they are, bf16 widened (exactly).
inline VecF load_weights(const float* p) { return in_register(load_f32(p)); }
inline VecF load_weights(const uint16_t* p) { return load_bf16(p); }
inline VecF load_weights_part(const float* row, int64_t k, int64_t k1) { return load_part(row, k, k1); }
inline VecF load_weights_part(const uint16_t* row, int64_t k, int64_t) { return load_bf16(row + k); }  // K % kLanes == 0

// out(m, n, x[m] . w[n]) for MR (1-4) rows of x, n in [n0, n1): each weight row is read start to
// end, so that a thread's weights are one sequential stream, the hardware prefetcher's best case
// (interleaving 3 rows as the tiles do measured 10-15% slower at one row). Two accumulators per
// row of x hide the FMA latency. W: float32, or bf16 with K a multiple of kLanes.
template <int MR, typename W, typename Out>
void gemv_rows(const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    VecF a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = zero();
    int64_t k = 0;
    for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
      const VecF w0 = load_weights(wr + k), w1 = load_weights(wr + k + kLanes);
      for (int m = 0; m < MR; ++m) {
        a[m][0] = fma(load_f32(x + m * K + k), w0, a[m][0]);
        a[m][1] = fma(load_f32(x + m * K + k + kLanes), w1, a[m][1]);
      }
    }
    for (; k < K; k += kLanes) {
      const VecF w0 = load_weights_part(wr, k, K);
      for (int m = 0; m < MR; ++m) a[m][0] = fma(load_part(x + m * K, k, K), w0, a[m][0]);
    }
    for (int m = 0; m < MR; ++m) out(m, n, hsum(add(a[m][0], a[m][1])));
  }
}

// gemv_rows for M in 1..4 rows.
template <typename W, typename Out>
void gemv_rows_of(int64_t M, const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  switch (M) {
    case 1: gemv_rows<1>(x, w, K, n0, n1, out); break;
    case 2: gemv_rows<2>(x, w, K, n0, n1, out); break;
    case 3: gemv_rows<3>(x, w, K, n0, n1, out); break;
    default: gemv_rows<4>(x, w, K, n0, n1, out); break;
  }
}

// K's pieces (kMaxKPiece at most, whole vectors): a function of K alone, so that every product with this
// K sums its pieces at the same places.
inline int64_t k_piece(int64_t K) {
  const int64_t pieces = (K + kMaxKPiece - 1) / kMaxKPiece;
  return ((K + pieces - 1) / pieces + kLanes - 1) / kLanes * kLanes;
}

}  // namespace

at::Tensor linear_f32(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_f32: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_f32: float32 only");
  TORCH_CHECK(x.size(1) % 8 == 0, "linear_f32: K must be a multiple of 8");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kMaxStreamRows) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      gemv_rows_of(M, xp, wp, K, begin, end, [&](int64_t m, int64_t n, float v) { yp[m * N + n] = v; });
    });
    return y;
  }
  const int64_t piece = k_piece(K);
  constexpr int NR = 3;
  const int64_t tiles = N / NR, rest = N - tiles * NR;
  at::parallel_for(0, tiles + (rest > 0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += piece) {
      const int64_t k1 = std::min(K, k0 + piece);
      for (int64_t t = begin; t < end; ++t) {
        const float* next = t + 1 < tiles ? wp + (t + 1) * NR * K : nullptr;
        if (t < tiles) linear_rows<NR>(xp, wp, M, K, k0, k1, t * NR, yp, N, next);
        else if (rest == 2) linear_rows<2>(xp, wp, M, K, k0, k1, t * NR, yp, N, nullptr);
        else linear_rows<1>(xp, wp, M, K, k0, k1, t * NR, yp, N, nullptr);
      }
    }
  });
  return y;
}

// ---- bf16 linear layers without AVX512-BF16 ----
//
// linear_bf16(x [M, K], w [N, K]) -> y [M, N] = x w^T for bf16 x and w, any M, K % kLanes == 0: the
// products summed in float32 and rounded once to bf16, as torch's bf16 F.linear gives them (to an ulp
// where the order of the float32 sums differs); float_out: y in float32, as summed.
// For CPUs without AVX512-BF16, where torch's bf16 GEMM runs at a fraction of its float32 rate (AVX2,
// Zen 3, 2026-12-03: ~17 GFLOP/s at every size from 16 to 512 rows, against 130-140 in float32). x
// is widened to float32 once per call. At 1..4 rows each weight row streams from memory and is widened
// as it is read (gemv_rows). At 5..47 a thread widens a panel of 3 weight rows by a piece of K into L1
// and walks linear_f32's register tiles down a block of up to kBf16RowBlock rows of x with it, so the
// widening is paid once per block of rows; from 48, the same with transposed panels of 16 columns
// under an outer-product tile (bf16_panels). Every output is summed in an order fixed by M's class
// (1..4, 5..47, or more) and K alone: not by its row's place in the batch, nor by how the columns are
// split between threads, so linear_bf16_slice's shares make the same y as the whole. A model's layers
// and output head pass their weights packed instead (see "packed bf16 weights" below); [N, K] is for
// the shapes that do not pack (N not a multiple of 16).

namespace {

constexpr int64_t kBf16RowBlock = 128;
constexpr int kBf16Tile = 3;  // weight rows per panel (linear_f32's tile)

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// n bf16 values widened into dst.
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_bf16(src + i));
  for (; i < n; ++i) dst[i] = bf16_bits_to_float(src[i]);
}

// A scratch buffer of at least n floats that only ever grows: resizing a std::vector back up after a
// smaller call zero-fills the difference, and the calls alternate between sizes (a layer's K is the
// hidden size or the MLP's, prefill chunks vary).
template <typename T>
inline T* scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Where linear_bf16 puts y[m, n]: rounded to bf16, or the float32 sum as it is (the output head's
// logits, which are never rounded to bf16: two close candidates would tie). Rounded as c10::BFloat16
// rounds: to nearest even, every NaN to the one quiet NaN 0x7FC0.
struct Bf16Out {
  void* y;
  int64_t N;
  bool float_out;
  void operator()(int64_t m, int64_t n, float v) const {
    if (float_out) static_cast<float*>(y)[m * N + n] = v;
    else static_cast<c10::BFloat16*>(y)[m * N + n] = c10::BFloat16(v);
  }
  // y[m, n0 + c] for c < cols from v[c], a vector at a time: at prefill sizes the outputs are as many
  // as a few percent of the FMAs, too many to round one by one.
  void row(int64_t m, int64_t n0, const float* v, int64_t cols) const {
    const VecF nan = splat(std::numeric_limits<float>::quiet_NaN());  // 0x7FC00000, c10's NaN widened
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      const VecF x = load_f32(v + c);
      if (float_out) store(static_cast<float*>(y) + m * N + n0 + c, x);
      else store_bf16(static_cast<uint16_t*>(y) + m * N + n0 + c, select(is_nan(x), nan, x));
    }
    for (; c < cols; ++c) (*this)(m, n0 + c, v[c]);
  }
};

// acc[m, j] (+)= x[m, k0:k0+len] . panel[j] for the M rows of x (rows xK apart, x at k0) and the nr
// (1..3) rows of a widened panel (rows len apart); acc rows are `stride` apart.
void bf16_panel_rows(const float* x, int64_t xK, int64_t M, const float* panel, int64_t len, int nr, float* acc,
                     int64_t stride, bool accumulate) {
  const auto run = [&](auto NRc) {
    constexpr int NR = decltype(NRc)::value;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) linear_tile<4, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr);
    switch (M - m) {
      case 3: linear_tile<3, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr); break;
      case 2: linear_tile<2, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr); break;
      case 1: linear_tile<1, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr); break;
      default: break;
    }
  };
  if (nr == 3) run(std::integral_constant<int, 3>{});
  else if (nr == 2) run(std::integral_constant<int, 2>{});
  else run(std::integral_constant<int, 1>{});
}

// For each block of up to kBf16RowBlock rows of x: pass(m0, mb, acc, panel) sums the block's rows
// against the columns [n0, n1) into acc [mb, n1 - n0] (float32), with `panel` (panel_floats) to widen
// weights into; then out.row() takes each row of sums.
template <typename Pass, typename Out>
void by_row_blocks(int64_t M, int64_t n0, int64_t n1, int64_t panel_floats, const Pass& pass, const Out& out) {
  const int64_t cols = n1 - n0;
  thread_local std::vector<float> panel_buffer, acc_buffer;  // kept and grown across calls
  float* panel = scratch(panel_buffer, panel_floats);
  float* acc = scratch(acc_buffer, std::min(kBf16RowBlock, M) * cols);
  for (int64_t m0 = 0; m0 < M; m0 += kBf16RowBlock) {
    const int64_t mb = std::min(kBf16RowBlock, M - m0);
    pass(m0, mb, acc, panel);
    for (int64_t m = 0; m < mb; ++m) out.row(m0 + m, n0, acc + m * cols, cols);
  }
}

// out(m, n, y[m, n]) for all M rows of x (widened, [M, K]) and the columns [n0, n1), from 5 rows up.
template <typename Out>
void bf16_tiles(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  const int64_t piece = k_piece(K), cols = n1 - n0;
  by_row_blocks(M, n0, n1, kBf16Tile * piece, [&](int64_t m0, int64_t mb, float* acc, float* panel) {
    const float* xb = x + m0 * K;
    // The weights of columns n..n+nr over [k0, k1) into the panel, then down the block of rows. Either
    // loop order sums the same pieces in the same order; pieces outside keeps a piece of the block of
    // x in L2 across the panels where the whole block would not fit, tiles outside reads each weight
    // row start to end where it does.
    const auto panel_pass = [&](int64_t n, int64_t k0) {
      const int64_t k1 = std::min(K, k0 + piece), len = k1 - k0;
      const int nr = static_cast<int>(std::min<int64_t>(kBf16Tile, n1 - n));
      for (int j = 0; j < nr; ++j) widen_bf16(w + (n + j) * K + k0, panel + j * len, len);
      bf16_panel_rows(xb + k0, K, mb, panel, len, nr, acc + (n - n0), cols, k0 > 0);
    };
    if (mb * K * static_cast<int64_t>(sizeof(float)) <= (256 << 10)) {
      for (int64_t n = n0; n < n1; n += kBf16Tile)
        for (int64_t k0 = 0; k0 < K; k0 += piece) panel_pass(n, k0);
    } else {
      for (int64_t k0 = 0; k0 < K; k0 += piece)
        for (int64_t n = n0; n < n1; n += kBf16Tile) panel_pass(n, k0);
    }
  }, out);
}

// From kPanelMinRows rows: an outer-product register tile. A panel holds kPanelCols columns of w by a
// piece of K (at most kPanelK: 16 KB, in L1), widened and transposed so that each k is a row of
// kPanelCols floats; kPanelRows rows of x at a time are each broadcast one value per k against the
// panel's row, into kPanelRows x kPanelVecs accumulators (12 of the 16 AVX2 registers). Per k: 2 panel loads
// and 6 broadcasts feed 12 FMAs, where the dot-product tiles above load 7 vectors for 12 and stream
// x from L2; each output is a single sum down k in its lane, with no horizontal sums.
constexpr int64_t kPanelMinRows = 48;
constexpr int kPanelCols = 16;
constexpr int kPanelVecs = kPanelCols / kLanes;
constexpr int kPanelRows = std::min(12, (kRegisters - kPanelVecs - 1) / kPanelVecs);  // AVX2: 6; AVX-512: 12
constexpr int64_t kPanelK = 256;

// K's pieces for the panels (kPanelK at most, whole vectors): a function of K alone.
inline int64_t panel_k_piece(int64_t K) {
  const int64_t pieces = (K + kPanelK - 1) / kPanelK;
  return ((K + pieces - 1) / pieces + kLanes - 1) / kLanes * kLanes;
}

// panel[k][c] = w[n + c][k0 + k] widened (rows of w K apart), for c < cols (zeros beyond, up to
// kPanelCols), k < len (a multiple of kLanes). W: bf16 (uint16_t) or float32.
template <typename W>
inline void widen_transposed(const W* w, int64_t K, int64_t n, int cols, int64_t k0, int64_t len, float* panel) {
  for (int64_t k = 0; k < len; k += kLanes)
    for (int c0 = 0; c0 < kPanelCols; c0 += kLanes) {
      VecF r[kLanes];
      for (int j = 0; j < kLanes; ++j) r[j] = c0 + j < cols ? load_weights(w + (n + c0 + j) * K + k0 + k) : zero();
      transpose_lanes(r);
      for (int i = 0; i < kLanes; ++i) store(panel + (k + i) * kPanelCols + c0, r[i]);
    }
}

// acc[m, c] (+)= x[m, 0:len] . panel[0:len, c] for MR rows of x (rows xK apart) and the panel's first
// `cols` columns; acc rows are `stride` apart, the panel's rows (kPanelCols floats) `panel_stride`.
template <int MR>
void panel_tile(const float* x, int64_t xK, const float* panel, int64_t len, float* acc, int64_t stride, int cols,
                bool accumulate, int64_t panel_stride = kPanelCols) {
  VecF c[MR][kPanelVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVecs; ++v) c[m][v] = zero();
  for (int64_t k = 0; k < len; ++k) {
    VecF b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) b[v] = load_f32(panel + k * panel_stride + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      const VecF a = splat(x[m * xK + k]);
      for (int v = 0; v < kPanelVecs; ++v) c[m][v] = fma(a, b[v], c[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float* row = acc + m * stride;
    if (cols == kPanelCols) {
      for (int v = 0; v < kPanelVecs; ++v)
        store(row + v * kLanes, accumulate ? add(load_f32(row + v * kLanes), c[m][v]) : c[m][v]);
    } else {
      float part[kPanelCols];
      for (int v = 0; v < kPanelVecs; ++v) store(part + v * kLanes, c[m][v]);
      for (int j = 0; j < cols; ++j) row[j] = accumulate ? row[j] + part[j] : part[j];
    }
  }
}

template <int MR = kPanelRows>
void panel_tile_rows(int64_t rows, const float* x, int64_t xK, const float* panel, int64_t len, float* acc,
                     int64_t stride, int cols, bool accumulate, int64_t panel_stride = kPanelCols) {
  if constexpr (MR >= 1) {
    if (rows == MR) panel_tile<MR>(x, xK, panel, len, acc, stride, cols, accumulate, panel_stride);
    else panel_tile_rows<MR - 1>(rows, x, xK, panel, len, acc, stride, cols, accumulate, panel_stride);
  }
}

// out(m, n, y[m, n]) for all M rows of x (widened, [M, K]) and the columns [n0, n1), from kPanelMinRows rows.
template <typename Out>
void bf16_panels(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  const int64_t piece = panel_k_piece(K), cols = n1 - n0;
  by_row_blocks(M, n0, n1, kPanelCols * piece, [&](int64_t m0, int64_t mb, float* acc, float* panel) {
    // Pieces outside: a piece of the block of x (128 KB at most) stays in L2 across the panels.
    for (int64_t k0 = 0; k0 < K; k0 += piece) {
      const int64_t len = std::min(K, k0 + piece) - k0;
      for (int64_t n = n0; n < n1; n += kPanelCols) {
        const int nc = static_cast<int>(std::min<int64_t>(kPanelCols, n1 - n));
        widen_transposed(w, K, n, nc, k0, len, panel);
        for (int64_t m = 0; m < mb; m += kPanelRows)
          panel_tile_rows(std::min<int64_t>(kPanelRows, mb - m), x + (m0 + m) * K + k0, K, panel, len,
                          acc + m * cols + (n - n0), cols, nc, k0 > 0);
      }
    }
  }, out);
}

// y's columns [n0, n1) for the widened x [M, K].
template <typename Out>
void linear_bf16_columns(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0, int64_t n1,
                         const Out& out) {
  if (M <= kMaxStreamRows) gemv_rows_of(M, x, w, K, n0, n1, out);
  else if (M < kPanelMinRows) bf16_tiles(x, w, M, K, n0, n1, out);
  else bf16_panels(x, w, M, K, n0, n1, out);
}

// ---- packed bf16 weights ----
//
// A weight packed once at load (kestrel/ops/dispatch.py: pack_bf16_weight) as [N / kPanelCols, K,
// kPanelCols]: panel p holds columns [16p, 16p + 16) with each k a row of 16 values, the layout an
// outer-product tile reads, the row's two halves interleaved (packed[p, k, 2j + h] = w[16p + 8h + j,
// k]) so that each 32-bit word holds two columns 8 apart (load_panel_row). A panel is one contiguous
// stream that the tile widens in registers as it reads it: no transpose per call (which cost ~0.9 ms
// a layer of the default model at 8 rows on 2 Zen 3 cores, more than the FMAs themselves) and no
// widened copy, so the one tile serves every row count.
// Every output is one sum down k per piece of K (panel_k_piece), the pieces added in order, whatever M
// is: a row of y does not depend on the batch at all (and from kPanelMinRows rows it is the sum that
// bf16_panels makes on [N, K]).

// The packed panel of columns [n, n + kPanelCols), rows [k0, k0 + len).
inline const uint16_t* packed_panel(const uint16_t* wp, int64_t K, int64_t n, int64_t k0) {
  return wp + (n / kPanelCols) * K * kPanelCols + k0 * kPanelCols;
}

// Panels widened in registers as they are read, for up to kPanelRows rows of x: P panels side by
// side, so that one row still has 2 x kPanelVecs x P independent sums (the FMA latency hidden).
template <int MR>
constexpr int kStreamPanels = std::max(1, 8 / (MR * kPanelVecs));

// The streamed tiles' sums: total (+)= a piece's sums c (the first piece sets it), in the pieces' order.
template <int MR, int V>
__attribute__((always_inline)) inline void add_piece(VecF (&total)[MR][V], const VecF (&c)[MR][V], bool first) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) total[m][v] = first ? c[m][v] : add(total[m][v], c[m][v]);
}

// out.row(m, n0, ...) of MR rows of V vectors of sums.
template <int MR, int V, typename Out>
__attribute__((always_inline)) inline void emit_rows(const VecF (&total)[MR][V], int64_t n0, const Out& out) {
  alignas(64) float row[V * kLanes];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) store(row + v * kLanes, total[m][v]);
    out.row(m, n0, row, V * kLanes);
  }
}

// How far ahead of its reads a row block that streams the panels from memory prefetches them, in k-rows
// of a panel (32 bytes each): 2 KB. At 2-16 rows the layer's four products of the default model ran
// 5-19% faster with it, at 64 and more as fast (2 Zen 3 cores, weights from memory, the builds taking
// turns); the row blocks that read a group from L2 after the first do without: prefetching there too
// cost 2-5% at 256-2048 rows. A prefetch past a weight's end is dropped (it never faults).
constexpr int64_t kPanelAheadRows = 64;

// out(m, n, y[m, n]) for MR rows of x (widened, [MR, K]) and the panels of [n0, n0 + P x kPanelCols);
// with Prefetch, the panels' stream is fetched kPanelAheadRows ahead.
template <int MR, int P, bool Prefetch, typename Out>
void packed_stream_panels(const float* x, const uint16_t* wp, int64_t K, int64_t n0, const Out& out) {
  constexpr int V = P * kPanelVecs;
  const int64_t piece = panel_k_piece(K);
  VecF total[MR][V];
  for (int64_t k0 = 0; k0 < K; k0 += piece) {
    const int64_t len = std::min(K, k0 + piece) - k0;
    VecF c[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) c[m][v] = zero();
    const uint16_t* panel[P];
    for (int p = 0; p < P; ++p) panel[p] = packed_panel(wp, K, n0 + p * kPanelCols, k0);
    for (int64_t k = 0; k < len; ++k) {
      VecF b[V];
      for (int p = 0; p < P; ++p) {
        if constexpr (Prefetch)
          _mm_prefetch(reinterpret_cast<const char*>(panel[p] + (k + kPanelAheadRows) * kPanelCols), _MM_HINT_T0);
        load_panel_row(panel[p] + k * kPanelCols, b + p * kPanelVecs);
      }
      for (int m = 0; m < MR; ++m) {
        const VecF a = splat(x[m * K + k0 + k]);
        for (int v = 0; v < V; ++v) c[m][v] = fma(a, b[v], c[m][v]);
      }
    }
    add_piece<MR, V>(total, c, k0 == 0);
  }
  emit_rows<MR, V>(total, n0, out);
}

// The columns [n0, n1) (multiples of kPanelCols) for MR rows.
template <int MR, bool Prefetch, typename Out>
void packed_stream(const float* x, const uint16_t* wp, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  constexpr int64_t span = kStreamPanels<MR> * kPanelCols;
  int64_t n = n0;
  for (; n + span <= n1; n += span) packed_stream_panels<MR, kStreamPanels<MR>, Prefetch>(x, wp, K, n, out);
  for (; n < n1; n += kPanelCols) packed_stream_panels<MR, 1, Prefetch>(x, wp, K, n, out);
}

// Rows shifted by m0: out.row(m0 + m, ...).
template <typename Out>
struct RowsFrom {
  const Out& out;
  int64_t m0;
  void row(int64_t m, int64_t n0, const float* v, int64_t cols) const { out.row(m0 + m, n0, v, cols); }
};

// f(std::integral_constant<int, MR>{}) for MR = min(rows, kPanelRows): a tile's rows as a constant.
template <typename F>
inline void with_panel_rows(int64_t rows, const F& f) {
  switch (std::min<int64_t>(kPanelRows, rows)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
#if defined(KESTREL_VEC_AVX512)
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 11: f(std::integral_constant<int, 11>{}); break;
#endif
    default: f(std::integral_constant<int, kPanelRows>{}); break;
  }
}

// A group of panels at a time (as many as one row streams side by side: 64 columns on AVX2), and under
// it the rows kPanelRows at a time, so that the group comes from memory once and from L2 after:
// stream(MRc, x's rows, n, n_end, their out, from_memory) runs one row group over the group's panels;
// from_memory: it is the group's first, the one that reads the panels from memory. Each row
// group converts the panels in registers as it reads them; against widening each panel piece into
// L1 once for all the rows (bf16_panels), this measured 1.03-1.5x faster at every row count from 16 to
// 1024 (2 Zen 3 cores, a layer's four products of the default model, packed bf16 weights).
template <typename Out, typename Stream>
void row_groups(const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1, const Out& out, const Stream& stream) {
  constexpr int64_t group = kStreamPanels<1> * kPanelCols;
  for (int64_t n = n0; n < n1; n += group) {
    const int64_t n_end = std::min(n1, n + group);
    for (int64_t m = 0; m < M; m += kPanelRows) {
      const RowsFrom<Out> rows_out{out, m};
      with_panel_rows(M - m, [&](auto MRc) { stream(MRc, x + m * K, n, n_end, rows_out, m == 0); });
    }
  }
}

template <typename Out>
void packed_row_groups(const float* x, const uint16_t* wp, int64_t M, int64_t K, int64_t n0, int64_t n1,
                       const Out& out) {
  row_groups(x, M, K, n0, n1, out, [&](auto MRc, const float* xm, int64_t n, int64_t n_end, const auto& rows,
                                       bool from_memory) {
    constexpr int MR = decltype(MRc)::value;
    if (from_memory) packed_stream<MR, true>(xm, wp, K, n, n_end, rows);
    else packed_stream<MR, false>(xm, wp, K, n, n_end, rows);
  });
}

// y's columns [n0, n1) (multiples of kPanelCols) for the widened x [M, K] and the packed w.
template <typename Out>
void linear_bf16_packed_columns(const float* x, const uint16_t* wp, int64_t M, int64_t K, int64_t n0, int64_t n1,
                                const Out& out) {
  packed_row_groups(x, wp, M, K, n0, n1, out);
}

// x [M, K] bf16 widened into this thread's buffer, kept and grown across calls (no allocation nor
// zeroing per call); large ones by all the threads.
const float* widened_x(const at::Tensor& x) {
  thread_local std::vector<float> x_buffer;
  const int64_t n = x.numel();
  float* xf = scratch(x_buffer, n);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  // The workers take the pointer: a thread_local named inside the lambda would be each worker's own.
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) { widen_bf16(xp + begin, xf + begin, end - begin); });
  return xf;
}

}  // namespace

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, bool float_out) {
  const bool packed = w.dim() == 3;
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || (packed && w.size(2) == kPanelCols)) && x.size(1) == w.size(1),
              "linear_bf16: x [M, K], w [N, K] or packed [N / ", kPanelCols, ", K, ", kPanelCols, "]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(x.size(1) % kLanes == 0, "linear_bf16: K must be a multiple of ", kLanes);
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed ? w.size(0) * kPanelCols : w.size(0);
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const float* xf = widened_x(x);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  const Bf16Out out{y.data_ptr(), N, float_out};
  if (packed) {  // whole panels to each thread
    at::parallel_for(0, N / kPanelCols, 1, [&](int64_t begin, int64_t end) {
      linear_bf16_packed_columns(xf, wp, M, K, begin * kPanelCols, end * kPanelCols, out);
    });
    return y;
  }
  // Whole tiles or panels of columns to each thread; a stream of rows is split finer (16 rows).
  const int64_t unit = M <= kMaxStreamRows ? 1 : M < kPanelMinRows ? kBf16Tile : kPanelCols;
  const int64_t grain = M <= kMaxStreamRows ? 16 : M < kPanelMinRows ? 8 : 2;
  at::parallel_for(0, (N + unit - 1) / unit, grain, [&](int64_t begin, int64_t end) {
    linear_bf16_columns(xf, wp, M, K, begin * unit, std::min(N, end * unit), out);
  });
  return y;
}

// One thread's share of linear_bf16 for 1..15 rows (kestrel_matmul::MatmulSliceFn): the columns
// [n_begin, n_end) of y, x widened by the thread itself; w [N, K], or packed where Packed.
template <bool Packed>
void linear_bf16_slice(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                       int64_t n_begin, int64_t n_end) {
  thread_local std::vector<float> x_buffer;
  float* xf = scratch(x_buffer, M * K);
  widen_bf16(x, xf, M * K);
  const Bf16Out out{y, N, false};
  if constexpr (Packed) linear_bf16_packed_columns(xf, w, M, K, n_begin, n_end, out);
  else linear_bf16_columns(xf, w, M, K, n_begin, n_end, out);
}

// ---- GGUF quantized weights ----
//
// linear_gguf(x [M, K] bf16, w) -> y [M, N] = x w^T, bf16 (or its float32 values), for a weight kept
// as a GGUF file stores it: llama.cpp's Q8_0 (Q5_0), Q6_K, Q4_K, Q4_1 (Q4_0), Q5 (Q5_1) or Q5_K
// blocks, packed at load (kestrel/ops/gguf_blocks.py: pack_gguf_weight) into panels of 16 columns (w's rows). w is one uint8
// tensor: a header of int64 (K, N, the number of segments, then for each segment its format, rows and
// byte offset), then the segments, each a run of whole panels in one format. A fused projection whose
// parts the file stores in different types (Q4_K_M's q and k in Q4_K, v in Q6_K) is one weight of
// several segments. Per panel of 16 columns and block along K:
//   Q8_0 (blocks of 32): 16 float32 scales, then the block's k-rows of 16 int8 (1.125 bytes a weight);
//   Q6_K (super-blocks of 256 in 16 blocks of 16): 16 float32 d, the blocks' int8 scales, then each
//     block's 6-bit q as nibbles and high bits in byte lanes (kQ6KQuants): 0.83 bytes a weight, against
//     0.82 in the file;
//   Q4_K (super-blocks of 256 in 8 sub-blocks of 32): 16 float32 d, 16 float32 dmin, the sub-blocks'
//     6-bit scales and mins as 8 x 16 bytes each, then 64 groups of 4 k-rows, 32 bytes each
//     (q4k_group_words): 0.59 bytes a weight, against 0.5625 in the file;
//   Q4_1 (blocks of 32; Q4_0 packed as Q4_1 with offset 8 d): 16 float32 d, 16 float32 offsets (-m),
//     then 8 groups of 4 k-rows as Q4_K's: 0.75 bytes a weight, against 0.625 in the file;
//   Q5 (Q5_1's blocks of 32; Q5_0 is packed as Q8_0, its q - 16 the int8): Q4_1's block of the q's
//     low 4 bits, then each group's fifth bits as two 32-bit words (bit i of the first: byte i's low
//     nibble's; of the second: its high nibble's), run on Q4_1's tiles with the bits added in: 0.875
//     bytes a weight, against 0.75 in the file;
//   Q5_K (Q4_K's super-blocks with 5-bit q): Q4_K's d, dmin, scales and mins, then each sub-block's q
//     in byte lanes as Q6_K's (kQ5KQuants): 0.72 bytes a weight, against 0.69 in the file.
//
// Q8_0 (and Q5_0, packed as it) runs its word tiles at every row count: each thread unpacks its panels once a call and
// sums each block of 32 in integers against x held as 16-bit integers per block (WordActivations: exact for every bf16
// x within 2^7 of the block's largest, the rest within 2^-15 of it), times d and the block's unit. Few rows (decode
// steps of a few requests: below kQ5KWordMinRows for Q5_K, kByteMinRows for the others) stream the packed panels
// through registers: Q6_K's and Q5_K's sum each block (of 16, of 32) in integers against x held as 14-bit integers
// split in two bytes (SplitActivations); Q4_K's, Q4_1's and the Q5s' sum each block of 32 as scale (sum x q) - min
// (sum x), the inner sums in 32-bit integers on the same 16-bit activations: on 2 Zen 3 cores, at 1 row, 0.85 ms
// against 1.40 with float sums and 1.8 with each weight dequantized (the 1B model's four layer shapes). From those
// row counts each thread unpacks its panels once a call: Q4_1's and the Q5s' q against the same 16-bit activations,
// summed in the streamed tiles' order (word_tile), so that Q8_0, Q4_0, Q4_1 and the Q5s give a row the same bits at
// every row count (batch invariance); Q4_K's and Q6_K's against x quantized to 8 bits, as
// llama.cpp runs its K-quants (see "against 8-bit activations" below).

namespace {

enum GgufFormat : int64_t { kGgufQ8_0 = 0, kGgufQ6_K = 1, kGgufQ4_K = 2, kGgufQ4_1 = 3, kGgufQ5 = 4, kGgufQ5_K = 5 };  // gguf_blocks.py's GGUF_FORMATS codes

constexpr int64_t kQuantScaleBytes = kPanelCols * sizeof(float);

// The int8 formats: blocks of B along K, a float32 scale per column and block.
template <int64_t B>
constexpr int64_t kInt8BlockBytes = kQuantScaleBytes + B * kPanelCols;
static_assert(kPanelK % 32 == 0, "panel pieces hold whole blocks where K allows");

template <int64_t B>
inline const uint8_t* int8_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / B) + b) * kInt8BlockBytes<B>;
}
inline const float* block_scales(const uint8_t* block) { return reinterpret_cast<const float*>(block); }
inline const int8_t* block_int8(const uint8_t* block) { return reinterpret_cast<const int8_t*>(block + kQuantScaleBytes); }

// Q4_K: super-blocks of 256 along K.
constexpr int64_t kQ4KBlock = 256, kQ4KSub = 32, kQ4KSubs = kQ4KBlock / kQ4KSub;
constexpr int64_t kQ4KMins = 2 * kQuantScaleBytes;                 // d at 0, dmin at 64
constexpr int64_t kQ4KSubMins = kQ4KMins + kQ4KSubs * kPanelCols;  // scales at 128, mins at 256
constexpr int64_t kQ4KQuants = kQ4KSubMins + kQ4KSubs * kPanelCols;
constexpr int64_t kQ4KBlockBytes = kQ4KQuants + kQ4KBlock / 2 * kPanelCols;
static_assert(kPanelK == kQ4KBlock, "a Q4_K super-block is one panel piece (K % 256 == 0)");

inline const uint8_t* q4k_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ4KBlock) + b) * kQ4KBlockBytes;
}

// Q4_1 (and Q4_0, packed as Q4_1): blocks of 32 along K, each 16 float32 d, 16 float32 offsets, then 8
// groups of 4 k-rows as Q4_K's (q4k_group_words); values d q - offset.
constexpr int64_t kQ4_1Quants = 2 * kQuantScaleBytes;
constexpr int64_t kQ4_1BlockBytes = kQ4_1Quants + kQ4KSub / 2 * kPanelCols;

// Q5_1 (packed as Q5): Q4_1's blocks of the low 4 bits, each followed by its 8 groups' fifth bits (two
// 32-bit words a group); values d q - offset.
constexpr int64_t kQ5FifthBits = kQ4_1BlockBytes;
constexpr int64_t kQ5BlockBytes = kQ5FifthBits + kQ4KSub / 4 * sizeof(uint64_t);

// Group g's fifth bits in a Q5 block: bits 0-31 of its low nibbles, 32-63 of its high ones.
inline uint64_t q5_fifth_bits(const uint8_t* block, int64_t g) {
  uint64_t bits;
  std::memcpy(&bits, block + kQ5FifthBits + g * sizeof bits, sizeof bits);
  return bits;
}

// Q6_K: super-blocks of 256 along K, in 16 blocks of 16 with an int8 scale each. Per panel and
// super-block: 16 float32 d, the blocks' scales (16 x 16 int8), then each block's q (the file's 0 .. 63;
// values d sc (q - 32)) in 192 bytes, byte 4c + t of each 64 holding column c's k-row t of a group of 4:
// the low nibbles of groups 0 and 1 (low and high nibble), of groups 2 and 3, then the high 2 bits of
// groups 0 .. 3 (bits 0-1, 2-3, 4-5, 6-7). Masks and shifts make each group's 64 q as bytes in place,
// 4 k-rows a 32-bit lane as the byte tiles take them. 0.83 bytes a weight, against 0.82 in the file.
constexpr int64_t kQ6KBlock = 256, kQ6KSub = 16, kQ6KSubs = kQ6KBlock / kQ6KSub;
constexpr int64_t kQ6KScales = kQuantScaleBytes;
constexpr int64_t kQ6KQuants = kQ6KScales + kQ6KSubs * kPanelCols;
constexpr int64_t kQ6KSubBytes = 3 * 4 * kPanelCols;
constexpr int64_t kQ6KBlockBytes = kQ6KQuants + kQ6KSubs * kQ6KSubBytes;
static_assert(kPanelK == kQ6KBlock, "a Q6_K super-block is one panel piece (K % 256 == 0)");

inline const uint8_t* q6k_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ6KBlock) + b) * kQ6KBlockBytes;
}

// Q5_K: Q4_K's super-blocks of 256 in 8 sub-blocks of 32, with 5-bit q (values d sc q - dmin m). Per panel and
// super-block: Q4_K's d, dmin, scales and mins (so q4k_scale_min reads them), then each sub-block's q (0 .. 31) in 320
// bytes, byte 4c + t of each 64 holding column c's k-row t of a group of 4: the fifth bits of groups 0 .. 7 (bit g),
// then the low 4 bits of groups 0 and 1 (low and high nibble), 2 and 3, 4 and 5, 6 and 7. (Read in that order: with the
// fifth bits last, so that the tile went back to the nibbles of groups 4 .. 7 after them, it took 1.2-1.3x the time
// from memory.) 0.72 bytes a weight, against 0.69 in the file, where Q4_1's blocks with the fifth bits beside (Q5) took
// 0.875 and twice the instructions of Q4_1 a weight.
constexpr int64_t kQ5KBlock = 256;
constexpr int64_t kQ5KQuants = kQ4KQuants;
constexpr int64_t kQ5KNibbles = 4 * kPanelCols;   // within a sub-block's q, after the fifth bits
constexpr int64_t kQ5KSubBytes = kQ5KNibbles + 4 * 4 * kPanelCols;
constexpr int64_t kQ5KBlockBytes = kQ5KQuants + kQ4KSubs * kQ5KSubBytes;
static_assert(kPanelK == kQ5KBlock, "a Q5_K super-block is one panel piece (K % 256 == 0)");

inline const uint8_t* q5k_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ5KBlock) + b) * kQ5KBlockBytes;
}

// Block b of the panel of column n: Q4_1's, or Q5's (Fifth).
template <bool Fifth>
inline const uint8_t* q4_1_like_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ4KSub) + b) * (Fifth ? kQ5BlockBytes : kQ4_1BlockBytes);
}

// Sub-block j's scale d * sc and min dmin * m of a panel's vector v: both products exact in float32.
inline void q4k_scale_min(const uint8_t* block, int64_t j, int v, VecF& scale, VecF& min) {
  const float* d = block_scales(block);
  const uint8_t* sc = block + kQ4KMins + j * kPanelCols + v * kLanes;
  scale = mul(load_f32(d + v * kLanes), load_uint8(sc));
  min = mul(load_f32(d + kPanelCols + v * kLanes), load_uint8(sc + kQ4KSubs * kPanelCols));
}

// A super-block's 4-bit q: 64 groups of 4 k-rows, each 32 bytes, byte 2c + t holding column c's q of
// k-row 4g + t in its low nibble and of k-row 4g + 2 + t in its high one. Widened to 16-bit lanes, the
// low nibbles are each column's pair of k-rows (4g, 4g + 1), the high ones (4g + 2, 4g + 3): the
// operands of a 16-bit multiply-add against the pair of activations. Vector v (kLanes columns) of group g:
inline VecI q4k_group_words(const uint8_t* block, int64_t g, int v) {
  return load_u8_words(block + kQ4KQuants + g * 2 * kPanelCols + v * 2 * kLanes);
}

// A block of 32 x as integers X = round(x 2^(Bits - e)), 2^e the power of two just above its largest
// |x| (|X| < 2^Bits); returns the unit 2^(e - Bits), and sum the block's sum of x. Zeros give X = 0. A
// NaN or infinity gives X = 0 (not an undefined cast) and a NaN unit, which reaches every output of its
// row.
template <int Bits>
inline float to_block_units(const float* xs, int16_t* X, float& sum) {
  VecF largest_lanes = zero(), sum_lanes = zero();
  for (int64_t t = 0; t < kQ4KSub; t += kLanes) {
    const VecF v = load_f32(xs + t);
    largest_lanes = max(largest_lanes, abs(v));
    sum_lanes = add(sum_lanes, v);
  }
  const float largest = hmax(largest_lanes);
  sum = hsum(sum_lanes);
  int e = 0;
  std::frexp(largest, &e);   // largest < 2^e
  const bool finite = std::isfinite(largest) && std::isfinite(sum);
  const bool scaled = largest > 0.f && finite;
  if (scaled && e - Bits >= -100) {   // 2^(Bits - e) a float: one exact multiply a lane
    const VecF to_units = splat(std::ldexp(1.f, Bits - e));
    for (int64_t t = 0; t < kQ4KSub; t += kLanes) store_int16_rounded(X + t, mul(load_f32(xs + t), to_units));
  } else {
    for (int64_t t = 0; t < kQ4KSub; ++t)
      X[t] = scaled ? static_cast<int16_t>(std::nearbyint(std::ldexp(xs[t], Bits - e))) : 0;
  }
  return scaled ? std::ldexp(1.f, e - Bits) : finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
}

// 16-bit activations, for Q4_K's streamed tiles and Q8_0's word tiles: each row's blocks of 32 as
// 16-bit integers X = round(x 2^-e) with 2^e = unit, the power of two that puts the block's largest
// |x| in [2^14, 2^15), and each block's sum of x. A bf16 x at most 2^7 below that largest is exact in
// X; a smaller one is off by at most unit / 2 (2^-15 of the largest), far below the bf16 rounding of y.
struct WordActivations {
  const float* x = nullptr;      // the widened rows [M, K], whose row m the streamed tiles are given as x + m K
  const int16_t* X = nullptr;    // [M, K]
  const float* unit = nullptr;   // [M, K / 32]
  const float* sum = nullptr;    // [M, K / 32]
  int64_t K = 0;

  static WordActivations of(const float* x, int64_t M, int64_t K) {
    thread_local std::vector<int16_t> X_buffer;
    thread_local std::vector<float> unit_buffer, sum_buffer;
    const int64_t subs = K / kQ4KSub;
    float* unit = scratch(unit_buffer, M * subs);
    float* sum = scratch(sum_buffer, M * subs);
    int16_t* X = scratch(X_buffer, M * K);
    // The workers take the pointers: thread_locals named inside the lambda would be each worker's own.
    at::parallel_for(0, M * subs, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) convert(x + i * kQ4KSub, X + i * kQ4KSub, unit[i], sum[i]);
    });
    return {x, X, unit, sum, K};
  }

  // One sub-block of 32: X, its unit and the sum of x.
  static void convert(const float* xs, int16_t* X, float& unit, float& sum) { unit = to_block_units<15>(xs, X, sum); }
};

// The two 4-bit formats (and Q5) as the streamed tiles read them: pieces of up to 8 sub-blocks of 32
// (Q4_K's super-block; Q4_1's and Q5's blocks, 8 at a time), sub-block j's scale and min (its values
// scale q - min) and its 8 groups of 4 k-rows, each as q4k_group_words (Q5: and their fifth bits).
struct Q4KBlocks {
  static constexpr bool kFifthBits = false;
  static constexpr int64_t kPieceSubs = kQ4KSubs;
  static int64_t piece_subs(int64_t, int64_t) { return kQ4KSubs; }
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) { return q4k_block(wq, K, n, b); }
  static void scale_min(const uint8_t* piece, int64_t j, int v, VecF& scale, VecF& min) {
    q4k_scale_min(piece, j, v, scale, min);
  }
  static VecI group_words(const uint8_t* piece, int64_t j, int64_t g, int v) {
    return q4k_group_words(piece, j * kQ4KSub / 4 + g, v);
  }
};

// Q4_1's blocks, and Q5's (Fifth: a block of kQ5BlockBytes, the fifth bits after the nibbles).
template <bool Fifth>
struct Q4_1LikeBlocks {
  static constexpr bool kFifthBits = Fifth;
  static constexpr int64_t kBlockBytes = Fifth ? kQ5BlockBytes : kQ4_1BlockBytes;
  static constexpr int64_t kPieceSubs = kQ4KSubs;
  static int64_t piece_subs(int64_t subs, int64_t b) { return std::min(kPieceSubs, subs - b * kPieceSubs); }
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
    return q4_1_like_block<Fifth>(wq, K, n, b * kPieceSubs);
  }
  static void scale_min(const uint8_t* piece, int64_t j, int v, VecF& scale, VecF& min) {
    const float* d = block_scales(piece + j * kBlockBytes);
    scale = load_f32(d + v * kLanes);
    min = load_f32(d + kPanelCols + v * kLanes);
  }
  static VecI group_words(const uint8_t* piece, int64_t j, int64_t g, int v) {
    return load_u8_words(piece + j * kBlockBytes + kQ4_1Quants + g * 2 * kPanelCols + v * 2 * kLanes);
  }
  // The low and high nibbles' words of vector v of group g with their fifth bits added (Q5).
  static void add_fifth_bits(const uint8_t* piece, int64_t j, int64_t g, int v, VecI& low, VecI& high) {
    uint64_t bits = q5_fifth_bits(piece + j * kBlockBytes, g);
    // One load into a register, each mask moved from there: with a mask load from memory per mask
    // (the compiler's choice otherwise) Q5_1 took 3.0x Q4_1's time at one row, from the register
    // 2.0-2.3x (2 Zen 4 cores, W6's four layer shapes).
    asm("" : "+r"(bits));
    low = with_fifth_bits(low, static_cast<uint32_t>(bits) >> (v * 2 * kLanes));
    high = with_fifth_bits(high, static_cast<uint32_t>(bits >> 32) >> (v * 2 * kLanes));
  }
};
using Q4_1Blocks = Q4_1LikeBlocks<false>;
using Q5Blocks = Q4_1LikeBlocks<true>;

// out.row() of MR rows of a 4-bit weight's P panels, rows given as their widened x (whose offset from
// a.x names them): sum_k x_k (scale q_k - min) over each sub-block of 32 as scale unit (sum_k X_k q_k)
// - min (sum_k x_k), the inner sums exact in 32-bit integers (16-bit multiply-adds of each column's
// pair of q against a pair of X: 7 vector operations per 32 weights, where widening q to float32 takes
// 14); the pieces' sums added in order.
template <typename Q4, int MR, int P, typename Out>
void q4_stream_panels(const WordActivations& a, const float* xm, const uint8_t* wq, int64_t n0, const Out& out) {
  constexpr int V = P * kPanelVecs;
  const int64_t K = a.K, row0 = (xm - a.x) / K, subs = K / kQ4KSub;
  VecF total[MR][V];
  for (int64_t b = 0; b * Q4::kPieceSubs < subs; ++b) {
    VecF c[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) c[m][v] = zero();
    const uint8_t* piece[P];
    for (int p = 0; p < P; ++p) piece[p] = Q4::piece(wq, K, n0 + p * kPanelCols, b);
    const int64_t piece_subs = Q4::piece_subs(subs, b);
    for (int64_t j = 0; j < piece_subs; ++j) {
      const int64_t sub = b * Q4::kPieceSubs + j;
      VecI acc[MR][V];
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) acc[m][v] = zero_i();
      for (int64_t g = 0; g < kQ4KSub / 4; ++g) {
        VecI low[V], high[V];
        for (int p = 0; p < P; ++p)
          for (int v = 0; v < kPanelVecs; ++v) {
            const VecI w = Q4::group_words(piece[p], j, g, v);
            low[p * kPanelVecs + v] = low_nibble_words(w);
            high[p * kPanelVecs + v] = high_nibble_words(w);
            if constexpr (Q4::kFifthBits) Q4::add_fifth_bits(piece[p], j, g, v, low[p * kPanelVecs + v],
                                                             high[p * kPanelVecs + v]);
          }
        const int64_t k = sub * kQ4KSub + 4 * g;
        for (int m = 0; m < MR; ++m) {
          int32_t pairs[2];
          std::memcpy(pairs, a.X + (row0 + m) * K + k, sizeof pairs);
          const VecI x01 = splat_i(pairs[0]), x23 = splat_i(pairs[1]);
          for (int v = 0; v < V; ++v)
            acc[m][v] = add_word_products(add_word_products(acc[m][v], low[v], x01), high[v], x23);
        }
      }
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < kPanelVecs; ++v) {
          VecF scale, min;
          Q4::scale_min(piece[p], j, v, scale, min);
          for (int m = 0; m < MR; ++m) {
            VecF& cv = c[m][p * kPanelVecs + v];
            const VecF dot = mul(to_float_lanes(acc[m][p * kPanelVecs + v]), splat(a.unit[(row0 + m) * subs + sub]));
            cv = fnmadd(min, splat(a.sum[(row0 + m) * subs + sub]), fma(scale, dot, cv));
          }
        }
    }
    add_piece<MR, V>(total, c, b == 0);
  }
  emit_rows<MR, V>(total, n0, out);
}

// Q6_K's and Q5_K's streamed tiles (below kByteMinRows and kQ5KWordMinRows rows) take x as 14-bit integers per block of
// 32, X = round(x 2^(14 - e)), 2^e the power of two just above the block's largest |x| (exact for every bf16 x within
// 2^6 of it, the rest within 2^-14 of it), split in two bytes, X = 128 Xh + Xl (Xh in [-128, 127], Xl in [0, 127]). A
// group's q (bytes, unpacked in place from the byte lanes) meets the 4 Xh and the 4 Xl of its k-rows in one vpdpbusd
// each, 64 products an instruction where the 16-bit tiles' vpmaddwd do 32 and need q widened to words first; per block,
// 128 (sum q Xh) + (sum q Xl) = sum X q exactly (|.| < 2^24), then the block's scale and offset in float32
// (ByteLaneQ6K, ByteLaneQ5K).
struct SplitActivations {
  const float* x = nullptr;       // the widened rows [M, K]
  const int8_t* high = nullptr;   // [M, K]: Xh
  const int8_t* low = nullptr;    // [M, K]: Xl
  const float* unit = nullptr;    // [M, K / 32]: 2^(e - 14)
  const int32_t* X_sum = nullptr; // [M, K / 16]: the sum of X over each block of 16
  int64_t K = 0;

  static SplitActivations of(const float* x, int64_t M, int64_t K) {
    thread_local std::vector<int8_t> high_buffer, low_buffer;
    thread_local std::vector<float> unit_buffer;
    thread_local std::vector<int32_t> sum_buffer;
    const int64_t subs = K / kQ4KSub;
    int8_t* high = scratch(high_buffer, M * K);
    int8_t* low = scratch(low_buffer, M * K);
    float* unit = scratch(unit_buffer, M * subs);
    int32_t* X_sum = scratch(sum_buffer, 2 * M * subs);
    // The workers take the pointers: thread_locals named inside the lambda would be each worker's own.
    at::parallel_for(0, M * subs, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        convert(x + i * kQ4KSub, high + i * kQ4KSub, low + i * kQ4KSub, unit[i], X_sum + 2 * i);
    });
    return {x, high, low, unit, X_sum, K};
  }

  // One block of 32: Xh, Xl, the unit and the sums of X.
  static void convert(const float* xs, int8_t* high, int8_t* low, float& unit, int32_t* X_sum) {
    int16_t X[kQ4KSub];
    float sum;
    unit = to_block_units<14>(xs, X, sum);
    X_sum[0] = X_sum[1] = 0;
    for (int64_t t = 0; t < kQ4KSub; ++t) {
      const int32_t v = std::min<int32_t>(X[t], (1 << 14) - 1);   // |x| < 2^e: v < 2^14 but for rounding up
      high[t] = static_cast<int8_t>(v >> 7);
      low[t] = static_cast<int8_t>(v & 127);
      X_sum[t / kQ6KSub] += v;
    }
  }
};

// The byte-lane formats as the streamed tiles read them: per panel, pieces (super-blocks) of kPiece
// k-rows in blocks of kBlock, each block's q unpacked to bytes 16 k-rows (4 groups) at a time, and the
// block's sum of X q made its share of y with its scale (and offset).
struct ByteLaneQ6K {
  static constexpr int64_t kPiece = kQ6KBlock, kBlock = kQ6KSub;
  // Panels side by side: at one row 4 (on 2 Zen 4 cores, in cache: 0.72-0.76x Q4_1's rate, against
  // 0.68x with 8 and 0.65x with 2; the AVX2 build from memory 0.75x the time of 1 panel); from 2 rows the
  // int8 tiles' count (at 4 rows 2 panels took 0.7-0.9x the time of 1).
  template <int MR>
  static constexpr int kPanels = MR == 1 ? 4 : kStreamPanels<MR>;
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) { return q6k_block(wq, K, n, b); }
  // Groups 0 .. 3 of block j (one h: a block is 16 k-rows), vector v.
  static void unpack(const uint8_t* piece, int64_t j, int, int v, VecI (&q)[4]) {
    const uint8_t* at = piece + kQ6KQuants + j * kQ6KSubBytes + v * 4 * kLanes;
    const VecI n01 = load_bytes(at), n23 = load_bytes(at + 4 * kPanelCols), h = load_bytes(at + 8 * kPanelCols);
    q[0] = with_high_bits<4, 0x30>(low_nibble_bytes(n01), h);
    q[1] = with_high_bits<2, 0x30>(high_nibble_bytes(n01), h);
    q[2] = with_high_bits<0, 0x30>(low_nibble_bytes(n23), h);
    q[3] = with_high_bits<-2, 0x30>(high_nibble_bytes(n23), h);
  }
  struct Scales { VecF scale; };
  static Scales scales(const uint8_t* piece, int64_t j, int v) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(piece + kQ6KScales) + j * kPanelCols + v * kLanes;
    return {mul(load_f32(block_scales(piece) + v * kLanes), load_int8(sc))};   // exact
  }
  // d sc unit (sum X q - 32 sum X) = d sc unit sum X (q - 32), the file's values (|.| <= 16 x 2^14 x 32:
  // exact in float32). X_sum: the block's sum of X.
  static VecF add_block(const Scales& s, VecI qX, const int32_t* X_sum, float unit, VecF c) {
    return fma(s.scale, mul(to_float_lanes(add_lanes(qX, splat_i(-32 * X_sum[0]))), splat(unit)), c);
  }
};

struct ByteLaneQ5K {
  static constexpr int64_t kPiece = kQ5KBlock, kBlock = kQ4KSub;
  // At one row 4 panels side by side, as Q6_K; at 2 rows (from kQ5KWordMinRows the word tiles run), as
  // Q4_K's 16-bit tiles, half Q6_K's count (2 Zen 4 cores, in cache, 1024 x 2048: 52-67 us against 64-66).
  template <int MR>
  static constexpr int kPanels = MR == 1 ? 4 : std::max(1, 4 / (MR * kPanelVecs));
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) { return q5k_block(wq, K, n, b); }
  // Groups 4h .. 4h + 3 of sub-block j (their fifth bits are bits 4h .. 4h + 3), vector v.
  static void unpack(const uint8_t* piece, int64_t j, int h, int v, VecI (&q)[4]) {
    const uint8_t* at = piece + kQ5KQuants + j * kQ5KSubBytes + v * 4 * kLanes;
    const VecI f = load_bytes(at);
    const VecI n01 = load_bytes(at + kQ5KNibbles + h * 8 * kPanelCols);
    const VecI n23 = load_bytes(at + kQ5KNibbles + (h * 8 + 4) * kPanelCols);
    if (h == 0) {
      q[0] = with_high_bits<4, 0x10>(low_nibble_bytes(n01), f);
      q[1] = with_high_bits<3, 0x10>(high_nibble_bytes(n01), f);
      q[2] = with_high_bits<2, 0x10>(low_nibble_bytes(n23), f);
      q[3] = with_high_bits<1, 0x10>(high_nibble_bytes(n23), f);
    } else {
      q[0] = with_high_bits<0, 0x10>(low_nibble_bytes(n01), f);
      q[1] = with_high_bits<-1, 0x10>(high_nibble_bytes(n01), f);
      q[2] = with_high_bits<-2, 0x10>(low_nibble_bytes(n23), f);
      q[3] = with_high_bits<-3, 0x10>(high_nibble_bytes(n23), f);
    }
  }
  struct Scales { VecF scale, min; };
  static Scales scales(const uint8_t* piece, int64_t j, int v) {
    Scales s;
    q4k_scale_min(piece, j, v, s.scale, s.min);
    return s;
  }
  // d sc unit (sum X q) - dmin m unit (sum X): both sums exact in float32 (< 2^24, < 2^20). X_sum: the
  // sums of X of the block's two halves.
  static VecF add_block(const Scales& s, VecI qX, const int32_t* X_sum, float unit, VecF c) {
    const VecF dot = mul(to_float_lanes(qX), splat(unit));
    return fnmadd(s.min, splat(static_cast<float>(X_sum[0] + X_sum[1]) * unit), fma(s.scale, dot, c));
  }
};

// out.row() of MR rows of a byte-lane weight's P panels (rows given as their widened x, whose offset
// from a.x names them): each block's share of y from its sum of X q, the blocks' shares added in order
// within a piece, the pieces' in order.
template <typename Q, int MR, int P, typename Out>
void byte_lane_stream_panels(const SplitActivations& a, const float* xm, const uint8_t* wq, int64_t n0,
                             const Out& out) {
  constexpr int V = P * kPanelVecs;
  const int64_t K = a.K, row0 = (xm - a.x) / K, subs = K / kQ4KSub;
  VecF total[MR][V];
  for (int64_t b = 0; b < K / Q::kPiece; ++b) {
    VecF c[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) c[m][v] = zero();
    const uint8_t* piece[P];
    for (int p = 0; p < P; ++p) piece[p] = Q::piece(wq, K, n0 + p * kPanelCols, b);
    for (int64_t j = 0; j < Q::kPiece / Q::kBlock; ++j) {
      const int64_t k = b * Q::kPiece + j * Q::kBlock;
      VecI high[MR][V], low[MR][V];
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) high[m][v] = low[m][v] = zero_i();
      for (int h = 0; h < Q::kBlock / 16; ++h)
        for (int p = 0; p < P; ++p)
          for (int v = 0; v < kPanelVecs; ++v) {
            VecI q[4];
            Q::unpack(piece[p], j, h, v, q);
            for (int m = 0; m < MR; ++m) {
              int32_t xh[4], xl[4];
              std::memcpy(xh, a.high + (row0 + m) * K + k + 16 * h, sizeof xh);
              std::memcpy(xl, a.low + (row0 + m) * K + k + 16 * h, sizeof xl);
              VecI& hi = high[m][p * kPanelVecs + v];
              VecI& lo = low[m][p * kPanelVecs + v];
              if constexpr (kFusedByteProducts) {
                for (int g = 0; g < 4; ++g) {
                  hi = add_byte_products(hi, q[g], splat_i(xh[g]));
                  lo = add_byte_products(lo, q[g], splat_i(xl[g]));
                }
              } else {   // two groups' pairs summed in 16 bits (at most 2 x 2 x 63 x 128 = 32256), then widened
                const VecI ones = splat_i(0x00010001);
                for (int g = 0; g < 4; g += 2) {
                  hi = add_lanes(hi, madd_words(add_words(madd_bytes(q[g], splat_i(xh[g])),
                                                          madd_bytes(q[g + 1], splat_i(xh[g + 1]))), ones));
                  lo = add_lanes(lo, madd_words(add_words(madd_bytes(q[g], splat_i(xl[g])),
                                                          madd_bytes(q[g + 1], splat_i(xl[g + 1]))), ones));
                }
              }
            }
          }
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < kPanelVecs; ++v) {
          const typename Q::Scales scales = Q::scales(piece[p], j, v);
          for (int m = 0; m < MR; ++m) {
            const int64_t row = row0 + m;
            const VecI qX = add_lanes(shift_left_lanes(high[m][p * kPanelVecs + v], 7), low[m][p * kPanelVecs + v]);
            VecF& cv = c[m][p * kPanelVecs + v];
            cv = Q::add_block(scales, qX, a.X_sum + row * 2 * subs + k / kQ6KSub, a.unit[row * subs + k / kQ4KSub], cv);
          }
        }
    }
    add_piece<MR, V>(total, c, b == 0);
  }
  emit_rows<MR, V>(total, n0, out);
}

// A format's streamed tiles.
template <typename Q4>
struct Q4Format {
  template <int MR>
  // Fewer panels side by side than the int8 tiles from 2 rows, each panel vector holding a sub-block's
  // sums and the piece's for every row (2 Zen 3 cores, the 1B model's layer shapes in Q4_K, 8 rows:
  // 6.3-6.6 ms against 7.5-7.9 with the int8 tiles' count; 1 row better with the int8 tiles' count).
  static constexpr int kPanels = MR == 1 ? kStreamPanels<1> : std::max(1, 4 / (MR * kPanelVecs));
  const WordActivations* activations;
  template <int MR, int P, typename Out>
  void stream_panels(const float* x, const uint8_t* wq, int64_t, int64_t n0, const Out& out) const {
    q4_stream_panels<Q4, MR, P>(*activations, x, wq, n0, out);
  }
};

template <typename Q>
struct ByteLaneFormat {
  template <int MR>
  static constexpr int kPanels = Q::template kPanels<MR>;
  const SplitActivations* activations;
  template <int MR, int P, typename Out>
  void stream_panels(const float* x, const uint8_t* wq, int64_t, int64_t n0, const Out& out) const {
    byte_lane_stream_panels<Q, MR, P>(*activations, x, wq, n0, out);
  }
};

// row_groups' walk (a group of panels, the rows kPanelRows at a time under it) on a format's stream.
template <typename Format, typename Out>
void quant_row_groups(const Format& format, const float* x, const uint8_t* wq, int64_t M, int64_t K, int64_t n0,
                      int64_t n1, const Out& out) {
  row_groups(x, M, K, n0, n1, out, [&](auto MRc, const float* xm, int64_t n, int64_t n_end, const auto& rows,
                                       bool) {
    constexpr int MR = decltype(MRc)::value;
    constexpr int P = Format::template kPanels<MR>;
    int64_t c = n;
    for (; c + P * kPanelCols <= n_end; c += P * kPanelCols) format.template stream_panels<MR, P>(xm, wq, K, c, rows);
    for (; c < n_end; c += kPanelCols) format.template stream_panels<MR, 1>(xm, wq, K, c, rows);
  });
}

// Columns shifted by n_offset: out.row(m, n_offset + n0, ...).
template <typename Out>
struct ColumnsFrom {
  const Out& out;
  int64_t n_offset;
  void row(int64_t m, int64_t n0, const float* v, int64_t cols) const { out.row(m, n_offset + n0, v, cols); }
};

struct GgufSegment {
  int64_t format, panel0, panels;  // its first panel in w's columns, and how many
  const uint8_t* data;
};

// A packed weight's header, checked against its size.
struct GgufLayout {
  int64_t K = 0, N = 0;
  std::vector<GgufSegment> segments;

  explicit GgufLayout(const at::Tensor& w) {
    TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() >= 24,
                "linear_gguf: w must be a packed GGUF weight (contiguous uint8, dispatch.py: pack_gguf_weight)");
    const uint8_t* base = w.data_ptr<uint8_t>();
    const auto header = [&](int64_t i) {
      int64_t v;
      std::memcpy(&v, base + 8 * i, sizeof v);
      return v;
    };
    K = header(0), N = header(1);
    const int64_t count = header(2);
    TORCH_CHECK(K > 0 && N > 0 && count > 0 && w.numel() >= 8 * (3 + 3 * count), "linear_gguf: bad header");
    int64_t panel = 0;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t format = header(3 + 3 * s), rows = header(4 + 3 * s), offset = header(5 + 3 * s);
      TORCH_CHECK(rows > 0 && rows % kPanelCols == 0, "linear_gguf: a segment of whole panels");
      const int64_t bytes = format == kGgufQ8_0 ? K / 32 * kInt8BlockBytes<32>
                            : format == kGgufQ6_K ? K / kQ6KBlock * kQ6KBlockBytes
                            : format == kGgufQ4_K ? K / kQ4KBlock * kQ4KBlockBytes
                            : format == kGgufQ4_1 ? K / kQ4KSub * kQ4_1BlockBytes
                            : format == kGgufQ5 ? K / 32 * kQ5BlockBytes
                            : format == kGgufQ5_K ? K / kQ5KBlock * kQ5KBlockBytes : -1;
      const int64_t block = format == kGgufQ6_K || format == kGgufQ4_K || format == kGgufQ5_K ? 256 : 32;
      TORCH_CHECK(bytes > 0 && K % block == 0, "linear_gguf: format ", format, " with K = ", K);
      TORCH_CHECK(offset >= 0 && offset + rows / kPanelCols * bytes <= w.numel(), "linear_gguf: a segment past the end");
      segments.push_back({format, panel, rows / kPanelCols, base + offset});
      panel += rows / kPanelCols;
    }
    TORCH_CHECK(panel * kPanelCols == N, "linear_gguf: the segments' rows are not N");
  }
};

// ---- Q4_K and Q6_K against 8-bit activations (from kByteMinRows rows); Q8_0, Q4_1 and the Q5s on 16-bit ones ----
//
// llama.cpp's way with its K-quants (their q against activations quantized to 8 bits), with a scale
// per block of 32 activations where its Q8_K has one per 256. Each row's blocks of 32 become int8,
// x ~ s q with s = max|x| / 127 and q = round_half_even(x (127 / max|x|)) (ByteActivations). A
// panel's q (Q4_K's 4-bit as they are, Q6_K's 6-bit + 32: unsigned bytes; BytePanel, made once a
// call) meet four activations at once in vpmaddubsw, whose 16-bit sums cannot saturate: Q4_K adds 8
// of them (a sub-block of 32; at most 8 x 2 x 15 x 127 = 30480), Q6_K 2 (at most 2 x 2 x 63 x 127 =
// 32004). vpmaddwd then sums each column's pair into 32 bits, times Q4_K's integer sub-block scale,
// and the rest is float32: per block of 32 times s (Q6_K: times d sc per 16), per Q4_K super-block
// times d, and last the offsets, minus sum_j offset[c][j] (s sum_j q), offset being Q4_K's dmin m per
// 32 and Q6_K's 32 d sc per 16 (its q are stored + 32). So y is the product of the dequantized
// weights and the dequantized activations, summed in float32 in another order (tests hold it to that
// product in float64). Each vpmaddubsw does 32 multiply-adds where an FMA does 8: on 2 Zen 3 cores,
// the 1B model's four layer shapes, against the kernels they replace (Q4_K's 16-bit tiles and float
// panels, Q6_K's float32 tiles and panels) Q4_K ran 1.3-1.8x faster from 16 to 512 rows and Q6_K
// 1.1-1.5x; at 8 rows, no faster than Q4_K's 16-bit tiles and slower than Q6_K's float ones, whence
// kByteMinRows.
//
// Q8_0's signed q would need vpsignb beside each vpmaddubsw (|q| against x with q's signs) and a
// vpmaddwd (two of its sums may overflow 16 bits): 4 instructions per 32 multiply-adds, as many as
// vpmaddwd on 16-bit activations takes (two, each 16). So Q8_0 takes those, WordActivations, exact to
// 2^-15 of each block's largest |x| where 8 bits would be to 2^-8: on 2 Zen 3 cores as fast as the
// 8-bit form (interleaved A/B, 8 to 2048 rows) and 1.1-1.3x the float32 tiles and panels it replaces
// from 8 rows. Against the float32 run of the default model requantized to Q8_0
// (benchmarks/gguf_teacher_forced.py), the 8-bit form's logprobs were off by 0.051 (median) and its
// top token differed at 5.2% of positions; the 16-bit form's 0.026 and 3.1%, the dequantized
// weights' in bf16 0.028 and 2.7%.
//
// Q4_1 (the default model's layers) takes the word tiles too, its q unpacked to Q8_0's pairs of int8,
// then minus the offsets times each block's sum of x. The 8-bit form ran W1 faster on 2 Zen 3 cores
// (32.4 s against 49.5 with the weights in bf16) but was farther from the float32 run (median logprob
// difference 0.040, top token 4.2%, against 0.025 and 3.5% on 16-bit activations) and flipped the
// near-tie of the default model's first answer to "What is the capital of France?".

constexpr int64_t kByteMinRows = 16;
// Q5_K's word tiles from here: its byte-lane panel unpacks once a call to the word panel, and the word
// tiles reuse each unpacked q for up to kPanelRows rows where the streamed tiles' 14-bit byte products
// hold two sums a row and vector (2 Zen 4 cores, in cache, 1024 x 2048: 3 rows 69 us against 80-83 on
// the streamed tiles, 4 rows 81 against 99-101, 8 rows 136 against 180-220; Q5_K packed as Q5 before,
// on its streamed tiles: 79, 92-93 and 126-128 us; 8 rows is the one count where this is slower, 1.07x).
constexpr int64_t kQ5KWordMinRows = 3;
constexpr int64_t kByteBlock = 32;                 // activations per int8 scale
constexpr int kByteRows = 6 / kPanelVecs;          // a tile's rows: 6 int16 accumulators (AVX2: 3 rows x 2)
constexpr int64_t kByteRowBlockBytes = 128 << 10;  // a thread's rows of int8 x at a time (in L2; as many 16-bit rows)
constexpr int64_t kByteRowsPanelByPanel = 64;      // up to here (or one row block) every row under each panel

// Each row's int8 activations, with what the tiles' float32 steps need.
struct ByteActivations {
  const int8_t* q = nullptr;     // [M, K]
  const float* scale = nullptr;  // [M, K / 32]: s
  const float* sum16 = nullptr;  // [M, K / 16]: s times the sum of q over each 16
  const float* sum32 = nullptr;  // [M, K / 32]: over each 32
  int64_t K = 0;

  static ByteActivations of(const float* x, int64_t M, int64_t K) {
    thread_local std::vector<int8_t> q_buffer;
    thread_local std::vector<float> scale_buffer, sum16_buffer, sum32_buffer;
    const int64_t blocks = K / kByteBlock;
    int8_t* q = scratch(q_buffer, M * K);
    float* scale = scratch(scale_buffer, M * blocks);
    float* sum16 = scratch(sum16_buffer, 2 * M * blocks);
    float* sum32 = scratch(sum32_buffer, M * blocks);
    // The workers take the pointers: thread_locals named inside the lambda would be each worker's own.
    at::parallel_for(0, M * blocks, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        quantize(x + i * kByteBlock, q + i * kByteBlock, scale[i], sum16 + 2 * i, sum32[i]);
    });
    return {q, scale, sum16, sum32, K};
  }

  // One block of 32. A NaN or infinity makes s NaN (q = 0), which reaches every output of its row.
  static void quantize(const float* xs, int8_t* q, float& scale, float* sum16, float& sum32) {
    VecF largest_lanes = zero(), sum_lanes = zero();
    for (int64_t t = 0; t < kByteBlock; t += kLanes) {
      const VecF v = load_f32(xs + t);
      largest_lanes = max(largest_lanes, abs(v));
      sum_lanes = add(sum_lanes, v);   // a NaN that max() drops stays here
    }
    const float largest = hmax(largest_lanes);
    if (!std::isfinite(largest) || !std::isfinite(hsum(sum_lanes)) || largest == 0.f) {
      std::memset(q, 0, kByteBlock);
      scale = sum32 = sum16[0] = sum16[1] = largest == 0.f ? 0.f : std::numeric_limits<float>::quiet_NaN();
      return;
    }
    scale = largest / 127.f;
    const VecF to_q = splat(127.f / largest);
    float sums[2];
    for (int h = 0; h < 2; ++h) {
      VecF s = zero();
      for (int64_t t = 16 * h; t < 16 * (h + 1); t += kLanes) {
        const VecF r = round_nearest(mul(load_f32(xs + t), to_q));   // |r| <= 127
        store_int8_rounded(q + t, r);
        s = add(s, r);
      }
      sums[h] = hsum(s);   // an integer, exact
    }
    sum16[0] = scale * sums[0];
    sum16[1] = scale * sums[1];
    sum32 = scale * (sums[0] + sums[1]);
  }
};

// A panel of kPanelCols columns as the byte tiles read it. q: each group of 4 k-rows 64 bytes, column
// c's four q at 4c (vector v of kLanes columns at 4 kLanes v), unsigned; for Q8_0's word tiles each
// pair of k-rows 32 bytes, column c's two int8 q at 2c. The rest per format (above).
struct BytePanel {
  uint8_t* q;             // [K / 4][16][4] (Q8_0: [K / 2][16][2]; bf16 panels: [K / 2][16][2] bf16)
  int16_t* scale_words;   // Q4_K: [K / 32][16][2], each sub-block's scale twice (vpmaddwd's pairs)
  float* scale;           // Q4_K: d [K / 256][16]; Q6_K: d sc [K / 16][16]; Q8_0, Q4_1, Q5: d [K / 32][16]; Q5_K: d sc
  float* offset;          // Q4_K: dmin m [K / 32][16]; Q6_K: 32 d sc [K / 16][16]; Q4_1, Q5: its offset [K / 32][16]; Q5_K: dmin m
};

// The byte panels of a thread's columns, made once a call.
struct BytePanels {
  std::vector<uint8_t> q;
  std::vector<int16_t> scale_words;
  std::vector<float> scale, offset;
  int64_t K = 0, q_bytes = 1;   // q's bytes a weight: 1, or 2 for bf16 panels
  BytePanel at(int64_t p) {
    return {q.data() + q_bytes * p * K * kPanelCols, scale_words.data() + p * (K / 16) * kPanelCols,
            scale.data() + p * (K / 16) * kPanelCols, offset.data() + p * (K / 16) * kPanelCols};
  }
  void hold(int64_t panels, int64_t k, int64_t bytes = 1) {
    K = k;
    q_bytes = bytes;
    scratch(q, q_bytes * panels * K * kPanelCols);
    scratch(scale_words, panels * (K / 16) * kPanelCols);
    scratch(scale, panels * (K / 16) * kPanelCols);
    scratch(offset, panels * (K / 16) * kPanelCols);
  }
};

// 16 columns' group of 4 k-rows: Q4_K's 32 bytes (byte 2c + t: q of k-row t in the low nibble, of
// k-row 2 + t in the high one) as 64 (bytes 4c .. 4c + 3: k-rows 0 .. 3).
inline void q4k_group_bytes(const uint8_t* src, uint8_t* dst) {
  const __m128i low4 = _mm_set1_epi8(15);
  for (int h = 0; h < 2; ++h) {   // columns 8h .. 8h + 7
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h));
    const __m128i low = _mm_and_si128(w, low4), high = _mm_and_si128(_mm_srli_epi16(w, 4), low4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * h), _mm_unpacklo_epi16(low, high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * h + 16), _mm_unpackhi_epi16(low, high));
  }
}

void q4k_byte_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  for (int64_t b = 0; b < K / kQ4KBlock; ++b) {
    const uint8_t* block = q4k_block(wq, K, n, b);
    const float* d = block_scales(block);
    for (int64_t c = 0; c < kPanelCols; ++c) p.scale[b * kPanelCols + c] = d[c];
    for (int64_t j = 0; j < kQ4KSubs; ++j) {
      const int64_t sub = b * kQ4KSubs + j;
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kQ4KMins + j * kPanelCols));
      const __m128i words[2] = {_mm_unpacklo_epi8(sc, _mm_setzero_si128()), _mm_unpackhi_epi8(sc, _mm_setzero_si128())};
      __m128i* scale_words = reinterpret_cast<__m128i*>(p.scale_words + sub * 2 * kPanelCols);
      for (int h = 0; h < 2; ++h) {   // each scale twice: columns 8h .. 8h + 3, then 8h + 4 .. 8h + 7
        _mm_storeu_si128(scale_words + 2 * h, _mm_unpacklo_epi16(words[h], words[h]));
        _mm_storeu_si128(scale_words + 2 * h + 1, _mm_unpackhi_epi16(words[h], words[h]));
      }
      for (int64_t c = 0; c < kPanelCols; c += 4) {   // dmin m: exact, as q4k_scale_min's
        int32_t mins;
        std::memcpy(&mins, block + kQ4KSubMins + j * kPanelCols + c, sizeof mins);
        const __m128 m = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(mins)));
        _mm_storeu_ps(p.offset + sub * kPanelCols + c, _mm_mul_ps(_mm_loadu_ps(d + kPanelCols + c), m));
      }
    }
    for (int64_t g = 0; g < kQ4KBlock / 4; ++g)
      q4k_group_bytes(block + kQ4KQuants + g * 2 * kPanelCols, p.q + (b * kQ4KBlock + 4 * g) * kPanelCols);
  }
}

// Q6_K: q as the unsigned bytes 0 .. 63 (its layout's groups as they are, the high bits put in), d sc
// per block of 16 and 32 d sc as the offset.
void q6k_byte_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  const __m128i low4 = _mm_set1_epi8(15), top2 = _mm_set1_epi8(0x30);
  const auto high_bits = [&](__m128i h, int shift) {   // bits 4-5 of each byte from h << shift (>> where negative)
    return _mm_and_si128(shift > 0 ? _mm_slli_epi16(h, shift) : _mm_srli_epi16(h, -shift), top2);
  };
  for (int64_t b = 0; b < K / kQ6KBlock; ++b) {
    const uint8_t* block = q6k_block(wq, K, n, b);
    const float* d = block_scales(block);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + kQ6KScales);
    for (int64_t j = 0; j < kQ6KSubs; ++j) {
      for (int64_t c = 0; c < kPanelCols; ++c) {
        const float scale = d[c] * static_cast<float>(sc[j * kPanelCols + c]);
        p.scale[(b * kQ6KSubs + j) * kPanelCols + c] = scale;
        p.offset[(b * kQ6KSubs + j) * kPanelCols + c] = 32.f * scale;
      }
      const uint8_t* src = block + kQ6KQuants + j * kQ6KSubBytes;
      uint8_t* dst = p.q + (b * kQ6KBlock + j * kQ6KSub) * kPanelCols;
      for (int64_t i = 0; i < 4 * kPanelCols; i += 16) {
        const auto load = [&](int64_t at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + i)); };
        const __m128i n01 = load(0), n23 = load(4 * kPanelCols), h = load(8 * kPanelCols);
        const __m128i q[4] = {_mm_or_si128(_mm_and_si128(n01, low4), high_bits(h, 4)),
                              _mm_or_si128(_mm_and_si128(_mm_srli_epi16(n01, 4), low4), high_bits(h, 2)),
                              _mm_or_si128(_mm_and_si128(n23, low4), _mm_and_si128(h, top2)),
                              _mm_or_si128(_mm_and_si128(_mm_srli_epi16(n23, 4), low4), high_bits(h, -2))};
        for (int g = 0; g < 4; ++g)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g * 4 * kPanelCols + i), q[g]);
      }
    }
  }
}

// 16 bits as 16 bytes, 16 where the bit is set, else 0.
inline __m128i fifth_bit_bytes(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits & 0xFFFF)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(16));
}

// Q4_1 (and Q5: Fifth) as Q8_0's word panel: a group's low nibbles are its columns' pairs of k-rows
// (4g, 4g + 1), its high ones (4g + 2, 4g + 3), each as an int8 0 .. 15 (Q5: plus 16 where its fifth bit
// is set); d and the offsets as they are.
template <bool Fifth>
void q4_1_like_word_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t b = 0; b < K / kQ4KSub; ++b) {
    const uint8_t* block = q4_1_like_block<Fifth>(wq, K, n, b);
    std::memcpy(p.scale + b * kPanelCols, block, kQuantScaleBytes);
    std::memcpy(p.offset + b * kPanelCols, block + kQuantScaleBytes, kQuantScaleBytes);
    for (int64_t g = 0; g < kQ4KSub / 4; ++g) {
      const uint64_t bits = Fifth ? q5_fifth_bits(block, g) : 0;
      for (int h = 0; h < 2; ++h) {   // columns 8h .. 8h + 7
        const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kQ4_1Quants + g * 2 * kPanelCols + 16 * h));
        __m128i low = _mm_and_si128(w, low4), high = _mm_and_si128(_mm_srli_epi16(w, 4), low4);
        if constexpr (Fifth) {
          low = _mm_or_si128(low, fifth_bit_bytes(static_cast<uint32_t>(bits) >> (16 * h)));
          high = _mm_or_si128(high, fifth_bit_bytes(static_cast<uint32_t>(bits >> 32) >> (16 * h)));
        }
        uint8_t* pairs = p.q + (b * kQ4KSub + 4 * g) * kPanelCols + 16 * h;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs), low);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + 2 * kPanelCols), high);
      }
    }
  }
}

// Q5_K as Q8_0's word panel: each sub-block's d sc and dmin m (q4k_scale_min's: the load's float32
// products), and each group's q (0 .. 31, unpacked as the streamed tiles unpack them) split into its
// columns' pairs of k-rows (4g, 4g + 1) and (4g + 2, 4g + 3).
void q5k_word_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  for (int64_t b = 0; b < K / kQ5KBlock; ++b) {
    const uint8_t* block = q5k_block(wq, K, n, b);
    for (int64_t j = 0; j < kQ4KSubs; ++j) {
      const int64_t sub = b * kQ4KSubs + j;
      for (int v = 0; v < kPanelVecs; ++v) {
        VecF scale, min;
        q4k_scale_min(block, j, v, scale, min);
        store(p.scale + sub * kPanelCols + v * kLanes, scale);
        store(p.offset + sub * kPanelCols + v * kLanes, min);
        for (int h = 0; h < 2; ++h) {
          VecI q[4];
          ByteLaneQ5K::unpack(block, j, h, v, q);
          for (int g = 0; g < 4; ++g) {
            uint8_t* pairs = p.q + (sub * kQ4KSub + 4 * (4 * h + g)) * kPanelCols + v * 2 * kLanes;
            store_byte_pairs(q[g], pairs, pairs + 2 * kPanelCols);
          }
        }
      }
    }
  }
}

// The word panel of a Q8_0, Q4_1, Q5 or Q5_K segment.
void word_panel(int64_t format, const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  if (format == kGgufQ4_1) q4_1_like_word_panel<false>(wq, K, n, p);
  else if (format == kGgufQ5) q4_1_like_word_panel<true>(wq, K, n, p);
  else q5k_word_panel(wq, K, n, p);
}

inline VecI four_activations(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return splat_i(v);
}

// total[m] -= sum_j offset[j] x sums[m][j] over the J offsets (J = K / 32 or K / 16) of the panel.
template <int MR, int V>
void subtract_offsets(VecF (&total)[MR][V], const float* offset, const float* sums, int64_t J) {
  for (int64_t j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) {
      const VecF o = load_f32(offset + j * kPanelCols + v * kLanes);
      for (int m = 0; m < MR; ++m) total[m][v] = fnmadd(o, splat(sums[m * J + j]), total[m][v]);
    }
}

template <int MR, int V>
void store_tile(const VecF (&total)[MR][V], float (*out)[kPanelCols]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) store(out[m] + v * kLanes, total[m][v]);
}

// out[m][c] for the MR rows from m0 and the panel's 16 columns. Not inlined (nor Q6_K's): inside
// byte_columns the register allocator spilled an accumulator of the inner loop.
template <int MR>
__attribute__((noinline)) void q4k_byte_tile(const ByteActivations& a, int64_t m0, const BytePanel& p, float (*out)[kPanelCols]) {
  constexpr int V = kPanelVecs;
  const int64_t K = a.K, blocks = K / kByteBlock;
  const int8_t* x = a.q + m0 * K;
  const float* s = a.scale + m0 * blocks;
  VecF total[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) total[m][v] = zero();
  for (int64_t b = 0; b < K / kQ4KBlock; ++b) {
    VecF in_d[MR][V];   // the super-block's sum in units of d
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) in_d[m][v] = zero();
    for (int64_t j = b * kQ4KSubs; j < (b + 1) * kQ4KSubs; ++j) {
      // The sub-block's products: in 16-bit halves (16 of at most 15 x 127 each) scaled by vpmaddwd,
      // or, with vpdpbusd, whole in 32 bits and scaled by a 32-bit multiply; the same integers.
      VecI acc[MR][V];
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) acc[m][v] = zero_i();
#pragma GCC unroll 8
      for (int64_t k = j * kQ4KSub; k < (j + 1) * kQ4KSub; k += 4) {
        VecI w[V];
        for (int v = 0; v < V; ++v) w[v] = in_register_i(load_bytes(p.q + k * kPanelCols + v * 4 * kLanes));
        for (int m = 0; m < MR; ++m) {
          const VecI x4 = four_activations(x + m * K + k);
          for (int v = 0; v < V; ++v)
            acc[m][v] = kFusedByteProducts ? add_byte_products(acc[m][v], w[v], x4) : add_words(acc[m][v], madd_bytes(w[v], x4));
        }
        // Without this GCC regroups the sums and spills the accumulators.
        for (int m = 0; m < MR; ++m)
          for (int v = 0; v < V; ++v) keep_in_register(acc[m][v]);
      }
      for (int v = 0; v < V; ++v) {
        const VecI sc = load_bytes(p.scale_words + j * 2 * kPanelCols + v * 2 * kLanes);
        for (int m = 0; m < MR; ++m) {
          const VecI in_units = kFusedByteProducts ? mul_lanes(acc[m][v], low_words(sc)) : madd_words(acc[m][v], sc);
          in_d[m][v] = fma(to_float_lanes(in_units), splat(s[m * blocks + j]), in_d[m][v]);
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const VecF d = load_f32(p.scale + b * kPanelCols + v * kLanes);
      for (int m = 0; m < MR; ++m) total[m][v] = fma(d, in_d[m][v], total[m][v]);
    }
  }
  subtract_offsets<MR, V>(total, p.offset, a.sum32 + m0 * blocks, blocks);
  store_tile<MR, V>(total, out);
}

template <int MR>
__attribute__((noinline)) void q6k_byte_tile(const ByteActivations& a, int64_t m0, const BytePanel& p, float (*out)[kPanelCols]) {
  constexpr int V = kPanelVecs;
  const int64_t K = a.K, blocks = K / kByteBlock;
  const int8_t* x = a.q + m0 * K;
  const float* s = a.scale + m0 * blocks;
  const VecI ones = splat_i(0x00010001);   // 16-bit ones: vpmaddwd sums each pair
  VecF total[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) total[m][v] = zero();
  for (int64_t j = 0; j < K / 16; ++j) {
    VecI acc[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = zero_i();
    for (int64_t k = 16 * j; k < 16 * (j + 1); k += 8) {
      VecI w0[V], w1[V];
      for (int v = 0; v < V; ++v) {
        w0[v] = in_register_i(load_bytes(p.q + k * kPanelCols + v * 4 * kLanes));
        w1[v] = in_register_i(load_bytes(p.q + (k + 4) * kPanelCols + v * 4 * kLanes));
      }
      for (int m = 0; m < MR; ++m) {
        const VecI x0 = four_activations(x + m * K + k), x1 = four_activations(x + m * K + k + 4);
        for (int v = 0; v < V; ++v)
          if constexpr (kFusedByteProducts)
            acc[m][v] = add_byte_products(add_byte_products(acc[m][v], w0[v], x0), w1[v], x1);
          else
            acc[m][v] = add_lanes(acc[m][v], madd_words(add_words(madd_bytes(w0[v], x0), madd_bytes(w1[v], x1)), ones));
      }
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) acc[m][v] = in_register_i(acc[m][v]);
    }
    for (int v = 0; v < V; ++v) {
      const VecF scale = load_f32(p.scale + j * kPanelCols + v * kLanes);
      for (int m = 0; m < MR; ++m)
        total[m][v] = fma(to_float_lanes(acc[m][v]), mul(scale, splat(s[m * blocks + j / 2])), total[m][v]);
    }
  }
  subtract_offsets<MR, V>(total, p.offset, a.sum16 + 2 * m0 * blocks, 2 * blocks);
  store_tile<MR, V>(total, out);
}

// Where a word tile reads a panel's weights: a made panel (Q4_1 and Q5: their q unpacked to Q8_0's pairs
// of k-rows), or Q8_0's packed blocks as they are, each pair of k-rows interleaved as it is loaded (no
// panel made a call: at one row, making the default model's head panel by panel cost more than its
// products).
struct MadeWords {
  BytePanel p;
  const int8_t* rows(int64_t j) const { return reinterpret_cast<const int8_t*>(p.q) + j * kByteBlock * kPanelCols; }
  static VecI words(const int8_t* rows, int64_t k, int v) { return load_i8_words(rows + k * kPanelCols + v * 2 * kLanes); }
  const float* d(int64_t j) const { return p.scale + j * kPanelCols; }
  const float* offset(int64_t j) const { return p.offset + j * kPanelCols; }
};

struct Q8_0BlockWords {
  const uint8_t* wq;
  int64_t K, n;   // the panel of column n
  const int8_t* rows(int64_t j) const { return block_int8(int8_block<32>(wq, K, n, j)); }
  static VecI words(const int8_t* rows, int64_t k, int v) {
    return load_i8_pair_words(rows + k * kPanelCols, rows + (k + 1) * kPanelCols, v);
  }
  const float* d(int64_t j) const { return block_scales(int8_block<32>(wq, K, n, j)); }
};

// Q8_0 (and Q4_1, Q5) against the 16-bit activations (WordActivations): each column's pair of q, widened
// to 16 bits, against a pair of X in vpmaddwd, summed exactly in 32 bits over a block (at most 32 x 128
// x 2^15 = 2^27), then in float32: Q8_0 times d unit into the row's total; Q4_1 and Q5 as their streamed
// tiles (q4_stream_panels) sum them, the block's sum times its unit, times d, minus offset x the block's
// sum of x, into a piece of kQ4KSubs blocks, the pieces added in order into `out`. Either way a row's
// result is the same bits at every row count (batch invariance).
// Panels side by side in a word tile, so that each broadcast pair of x serves more columns: 2 with
// AVX-512 (6 rows x 2 panels: 12 integer and 12 float32 accumulators), 1 on AVX2's 16 registers.
constexpr int kWordPanels = kPanelVecs == 1 ? 2 : 1;

template <int64_t Format, int MR, int P, typename Words>
__attribute__((noinline)) void word_tile(const WordActivations& a, int64_t m0, const Words* src,
                                         float (*out)[kPanelCols]) {
  // out: panel p's row m at out[p * kByteRows + m]
  constexpr int V = kPanelVecs, PV = P * V;
  const int64_t K = a.K, blocks = K / kByteBlock;
  const int16_t* x = a.X + m0 * K;
  const float* unit = a.unit + m0 * blocks;
  const float* sum = a.sum + m0 * blocks;
  VecF total[MR][PV];   // Q8_0: the rows' sums; Q4_1 and Q5: the current piece's
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < PV; ++i) total[m][i] = zero();
  // Integer sums are exact in any order: with one or two rows, A accumulators a row take the k-pairs in
  // turn, so that the multiply-adds do not wait on each other (a decode step's output head at one row).
  constexpr int A = MR == 1 ? 4 / P : MR == 2 ? 2 / P : 1;
  for (int64_t j = 0; j < blocks; ++j) {
    const int8_t* rows[P];
    for (int p = 0; p < P; ++p) rows[p] = src[p].rows(j);
    VecI part[A][MR][PV];
    for (int i = 0; i < A; ++i)
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < PV; ++c) part[i][m][c] = zero_i();
#pragma GCC unroll 16
    for (int64_t k = 0; k < kByteBlock; k += 2) {
      VecI (&acc)[MR][PV] = part[(k / 2) % A];
      VecI w[PV];
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < V; ++v) w[p * V + v] = in_register_i(Words::words(rows[p], k, v));
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + j * kByteBlock + k, sizeof pair);
        const VecI x2 = splat_i(pair);
        for (int c = 0; c < PV; ++c) acc[m][c] = add_word_products(acc[m][c], w[c], x2);
      }
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < PV; ++c) keep_in_register(acc[m][c]);
    }
    VecI (&acc)[MR][PV] = part[0];
    for (int i = 1; i < A; ++i)
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < PV; ++c) acc[m][c] = add_lanes(acc[m][c], part[i][m][c]);
    for (int p = 0; p < P; ++p) {
      const float* d = src[p].d(j);
      if constexpr (Format == kGgufQ8_0) {
        for (int v = 0; v < V; ++v) {
          const VecF dv = load_f32(d + v * kLanes);
          for (int m = 0; m < MR; ++m) {
            VecF& t = total[m][p * V + v];
            t = fma(to_float_lanes(acc[m][p * V + v]), mul(dv, splat(unit[m * blocks + j])), t);
          }
        }
      } else {
        const float* offset = src[p].offset(j);
        for (int v = 0; v < V; ++v) {
          const VecF dv = load_f32(d + v * kLanes), o = load_f32(offset + v * kLanes);
          for (int m = 0; m < MR; ++m) {
            VecF& t = total[m][p * V + v];
            const VecF dot = mul(to_float_lanes(acc[m][p * V + v]), splat(unit[m * blocks + j]));
            t = fnmadd(o, splat(sum[m * blocks + j]), fma(dv, dot, t));
          }
        }
      }
    }
    if constexpr (Format != kGgufQ8_0) {
      if (j % kQ4KSubs == kQ4KSubs - 1 || j == blocks - 1) {   // the piece ends: into out, in order
        for (int m = 0; m < MR; ++m)
          for (int p = 0; p < P; ++p)
            for (int v = 0; v < V; ++v) {
              float* o = out[p * kByteRows + m] + v * kLanes;
              VecF& t = total[m][p * V + v];
              store(o, j < kQ4KSubs ? t : add(load_f32(o), t));
              t = zero();
            }
      }
    }
  }
  if constexpr (Format == kGgufQ8_0) {
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < V; ++v) store(out[p * kByteRows + m] + v * kLanes, total[m][p * V + v]);
  }
}

// rows (1 .. kByteRows) rows from m0 on P word panels.
template <int64_t Format, int P, int MR = kByteRows, typename Words>
void word_tile_rows(int rows, const WordActivations& words, int64_t m0, const Words* src, float (*out)[kPanelCols]) {
  if constexpr (MR > 1) {
    if (rows < MR) return word_tile_rows<Format, P, MR - 1>(rows, words, m0, src, out);
  }
  word_tile<Format, MR, P>(words, m0, src, out);
}

// The columns [n0, n1) of a Q8_0 segment (Q8_0 and Q5_0), every row on the word tiles, read straight
// from the packed blocks: kWordPanels panels at a time, kByteRows rows at a time down them.
template <typename Out>
void q8_0_columns(const WordActivations& words, const GgufSegment& s, int64_t M, int64_t n0, int64_t n1,
                  const Out& out) {
  alignas(64) float tile[kWordPanels * kByteRows][kPanelCols];
  const auto run = [&](auto Pc, int64_t n) {
    constexpr int P = decltype(Pc)::value;
    Q8_0BlockWords src[P];
    for (int p = 0; p < P; ++p) src[p] = Q8_0BlockWords{s.data, words.K, n + p * kPanelCols};
    for (int64_t m = 0; m < M; m += kByteRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kByteRows, M - m));
      word_tile_rows<kGgufQ8_0, P>(rows, words, m, src, tile);
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < rows; ++r) out.row(m + r, n + p * kPanelCols, tile[p * kByteRows + r], kPanelCols);
    }
  };
  int64_t n = n0;
  for (; n + kWordPanels * kPanelCols <= n1; n += kWordPanels * kPanelCols) run(std::integral_constant<int, kWordPanels>{}, n);
  for (; n < n1; n += kPanelCols) run(std::integral_constant<int, 1>{}, n);
}

// Whether the format's unpacked panels meet the 16-bit activations (the word tiles), not the 8-bit ones.
inline bool on_words(int64_t format) {
  return format == kGgufQ8_0 || format == kGgufQ4_1 || format == kGgufQ5 || format == kGgufQ5_K;
}

// rows (1 .. kByteRows) rows from m0 on the format's tile of that many rows.
template <int MR = kByteRows>
void byte_tile_rows(int64_t format, int rows, const ByteActivations& a, const WordActivations& words, int64_t m0,
                    const BytePanel& p, float (*out)[kPanelCols]) {
  if constexpr (MR > 1) {
    if (rows < MR) return byte_tile_rows<MR - 1>(format, rows, a, words, m0, p, out);
  }
  if (format == kGgufQ4_K) q4k_byte_tile<MR>(a, m0, p, out);
  else if (format == kGgufQ6_K) q6k_byte_tile<MR>(a, m0, p, out);
  else {   // Q4_1 and the Q5s: one panel, with offsets
    const MadeWords made{p};
    word_tile<kGgufQ4_1, MR, 1>(words, m0, &made, out);
  }
}

// The columns [n0, n1) of a segment on the byte tiles (Q8_0: the word tiles): its panels made once,
// then the rows a block at a time (whose x stays in L2) down every panel.
template <typename Out>
void byte_columns(const ByteActivations& a, const WordActivations& words, const GgufSegment& s, int64_t M, int64_t n0,
                  int64_t n1, const Out& out) {
  const int64_t K = on_words(s.format) ? words.K : a.K, panels = (n1 - n0) / kPanelCols;
  const auto make = [&](int64_t p, const BytePanel& panel) {
    if (s.format == kGgufQ4_K) q4k_byte_panel(s.data, K, n0 + p * kPanelCols, panel);
    else if (s.format == kGgufQ6_K) q6k_byte_panel(s.data, K, n0 + p * kPanelCols, panel);
    else word_panel(s.format, s.data, K, n0 + p * kPanelCols, panel);
  };
  alignas(64) float tile[kByteRows][kPanelCols];
  const auto rows_of = [&](int64_t p, const BytePanel& panel, int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; m += kByteRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kByteRows, m_end - m));
      byte_tile_rows(s.format, rows, a, words, m, panel, tile);
      for (int r = 0; r < rows; ++r) out.row(m + r, n0 + p * kPanelCols, tile[r], kPanelCols);
    }
  };
  thread_local BytePanels made;
  const int64_t row_block = std::max<int64_t>(kByteRows, kByteRowBlockBytes / K / kByteRows * kByteRows);
  if (on_words(s.format) && kWordPanels > 1) {
    // Q4_1 and the Q5s: kWordPanels made panels side by side in each word tile.
    alignas(64) float wtile[kWordPanels * kByteRows][kPanelCols];
    const auto group_rows = [&](auto Pc, int64_t p, int first_made, int64_t m_begin, int64_t m_end) {
      constexpr int P = decltype(Pc)::value;
      MadeWords src[P];
      for (int i = 0; i < P; ++i) src[i] = MadeWords{made.at(first_made + i)};
      for (int64_t m = m_begin; m < m_end; m += kByteRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kByteRows, m_end - m));
        word_tile_rows<kGgufQ4_1, P>(rows, words, m, src, wtile);
        for (int i = 0; i < P; ++i)
          for (int r = 0; r < rows; ++r)
            out.row(m + r, n0 + (p + i) * kPanelCols, wtile[i * kByteRows + r], kPanelCols);
      }
    };
    const bool panel_by_panel = M <= std::max(row_block, kByteRowsPanelByPanel);
    made.hold(panel_by_panel ? kWordPanels : panels, K);
    if (!panel_by_panel)
      for (int64_t p = 0; p < panels; ++p) make(p, made.at(p));
    for (int64_t m1 = 0; m1 < M; m1 += panel_by_panel ? M : row_block) {
      const int64_t m2 = panel_by_panel ? M : std::min(M, m1 + row_block);
      int64_t p = 0;
      for (; p + kWordPanels <= panels; p += kWordPanels) {
        if (panel_by_panel)
          for (int i = 0; i < kWordPanels; ++i) make(p + i, made.at(i));
        group_rows(std::integral_constant<int, kWordPanels>{}, p, panel_by_panel ? 0 : static_cast<int>(p), m1, m2);
      }
      for (; p < panels; ++p) {
        if (panel_by_panel) make(p, made.at(0));
        group_rows(std::integral_constant<int, 1>{}, p, panel_by_panel ? 0 : static_cast<int>(p), m1, m2);
      }
    }
    return;
  }
  if (M <= std::max(row_block, kByteRowsPanelByPanel)) {
    // Few rows (decode steps): each panel made just before its rows run, while it is in L1 and L2,
    // instead of all of them written out to memory and read back (16 rows: 108 against 82 GFLOP/s).
    made.hold(1, K);
    for (int64_t p = 0; p < panels; ++p) {
      make(p, made.at(0));
      rows_of(p, made.at(0), 0, M);
    }
    return;
  }
  made.hold(panels, K);
  for (int64_t p = 0; p < panels; ++p) make(p, made.at(p));
  for (int64_t m1 = 0; m1 < M; m1 += row_block)
    for (int64_t p = 0; p < panels; ++p) rows_of(p, made.at(p), m1, std::min(M, m1 + row_block));
}

// Whether the format's M rows run on panels unpacked once a call (the byte and word tiles).
bool on_unpacked_panels(int64_t format, int64_t M) {
  return format == kGgufQ8_0 || M >= (format == kGgufQ5_K ? kQ5KWordMinRows : kByteMinRows);
}

template <typename Out>
void gguf_columns(const float* x, const WordActivations* activations, const SplitActivations* split,
                  const ByteActivations* bytes, const GgufSegment& s, int64_t M, int64_t K, int64_t n0, int64_t n1,
                  const Out& out) {
  const ColumnsFrom<Out> shifted{out, s.panel0 * kPanelCols};
  if (s.format == kGgufQ8_0) q8_0_columns(*activations, s, M, n0, n1, shifted);
  else if (on_unpacked_panels(s.format, M)) byte_columns(*bytes, *activations, s, M, n0, n1, shifted);
  else if (s.format == kGgufQ6_K) quant_row_groups(ByteLaneFormat<ByteLaneQ6K>{split}, x, s.data, M, K, n0, n1, shifted);
  else if (s.format == kGgufQ5_K) quant_row_groups(ByteLaneFormat<ByteLaneQ5K>{split}, x, s.data, M, K, n0, n1, shifted);
  else if (s.format == kGgufQ5) quant_row_groups(Q4Format<Q5Blocks>{activations}, x, s.data, M, K, n0, n1, shifted);
  else if (s.format == kGgufQ4_K) quant_row_groups(Q4Format<Q4KBlocks>{activations}, x, s.data, M, K, n0, n1, shifted);
  else quant_row_groups(Q4Format<Q4_1Blocks>{activations}, x, s.data, M, K, n0, n1, shifted);
}

}  // namespace

at::Tensor linear_gguf(at::Tensor x, at::Tensor w, bool float_out) {
  const GgufLayout layout(w);
  const int64_t K = layout.K, N = layout.N;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "linear_gguf: x must be bf16 [M, ", K, "]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const float* xf = widened_x(x);
  const auto any_segment = [&](const auto& pred) { return std::any_of(layout.segments.begin(), layout.segments.end(), pred); };
  // 16-bit activations: the streamed tiles' of Q4_1, Q4_K and Q5, the word tiles' of Q8_0, Q4_1 and the Q5s.
  const bool words_used = any_segment([&](const GgufSegment& s) {
    const bool unpacked = on_unpacked_panels(s.format, M);
    return unpacked ? on_words(s.format)
                    : s.format == kGgufQ4_1 || s.format == kGgufQ4_K || s.format == kGgufQ5;
  });
  const WordActivations activations = words_used ? WordActivations::of(xf, M, K) : WordActivations{};
  const bool split_used = any_segment([&](const GgufSegment& s) {
    return (s.format == kGgufQ6_K || s.format == kGgufQ5_K) && !on_unpacked_panels(s.format, M);
  });
  const SplitActivations split = split_used ? SplitActivations::of(xf, M, K) : SplitActivations{};
  const bool bytes_used = any_segment([&](const GgufSegment& s) { return !on_words(s.format) && on_unpacked_panels(s.format, M); });
  const ByteActivations bytes = bytes_used ? ByteActivations::of(xf, M, K) : ByteActivations{};
  const Bf16Out out{y.data_ptr(), N, float_out};
  at::parallel_for(0, N / kPanelCols, 1, [&](int64_t begin, int64_t end) {
    for (const GgufSegment& s : layout.segments) {
      const int64_t p0 = std::max(begin, s.panel0), p1 = std::min(end, s.panel0 + s.panels);
      if (p0 < p1)
        gguf_columns(xf, &activations, &split, &bytes, s, M, K, (p0 - s.panel0) * kPanelCols,
                     (p1 - s.panel0) * kPanelCols, out);
    }
  });
  return y;
}

// ---- prefill attention ----
//
// prefill_attention(q [Lq, H, D], k and v [Lk, KV, D], scale) -> [Lq, H, D] in q's dtype, float32 or
// bf16 (any row and head strides, the last dim contiguous; D % 16 == 0, Lk >= Lq): causal attention of
// a chunk of queries over its keys, the queries being the last Lq (query i sits at position
// Lk - Lq + i and sees keys 0 .. Lk - Lq + i), query head h reading KV head h / (H / KV). The contract
// of cpu_prefill.cpp's kernels, for CPUs without AVX512-BF16 and for float32 models, where SDPA's CPU
// flash attention reaches 35-70 GFLOP/s and this kernel 95-125 (2 Zen 3 cores, the default model's
// heads, 128-1024 keys). Its PyTorch reference is SDPA (kestrel/attention/torch_sdpa.py:
// prefill_attention), whose arithmetic it keeps: scores and sums in float32, the softmax in float32,
// and in a bf16 model the weights rounded to bf16 before they multiply V.
//
// Both products run on the bf16 linear layers' outer-product register tile (panel_tile). K is packed
// once per call as panels of 16 keys (each d a row of 16 keys, widened to float32) and V widened as it
// is. A work item is one KV head and a block of queries whose rows are (query, query head of the
// group) pairs, so that the G heads sharing K and V read them together. It walks its keys kKeyChunk
// at a time, up to its last query's position: the chunk's scores S = Q K^T, then each row's online
// softmax (running max and sum; the row's output rescaled when the max rises), then O += P V. A row's
// result depends on nothing but its own query, so any block or thread count gives the same output.

namespace {

constexpr int64_t kKeyChunk = 256;                   // keys per step: a block's scores stay in L1/L2
constexpr int64_t kAttentionRows = 4 * kPanelRows;   // rows per work item (24 on AVX2, 48 on AVX-512)

struct PrefillShape {
  int64_t lq, lk, heads, kv_heads, d, group;
  int64_t lk_pad;          // keys rounded up to whole panels
  int64_t block_queries;   // queries per work item
};

// A row of the model dtype as widen_transposed reads it (bf16 as its bits).
inline const uint16_t* raw(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const float* raw(const float* p) { return p; }

// K of every KV head as panels of kPanelCols keys, kp [KV][lk_pad / 16][D][16], and V as vp
// [KV][lk_pad][D], both float32, keys past Lk zero.
template <typename T>
void pack_keys_and_values(const at::Tensor& k, const at::Tensor& v, const PrefillShape& s, float* kp,
                          float* vp) {
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  const int64_t panels = s.lk_pad / kPanelCols, d = s.d;
  at::parallel_for(0, s.kv_heads * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / panels, n = (i % panels) * kPanelCols;
      const int keys = static_cast<int>(std::min<int64_t>(kPanelCols, s.lk - n));
      float* panel = kp + (h * panels + n / kPanelCols) * d * kPanelCols;
      widen_transposed(raw(kd + h * k.stride(1)), k.stride(0), n, keys, 0, d, panel);
      for (int64_t key = n; key < n + kPanelCols; ++key) {
        float* row = vp + (h * s.lk_pad + key) * d;
        const T* src = vd + key * v.stride(0) + h * v.stride(1);
        for (int64_t j = 0; j < d; j += kLanes) store(row + j, key < s.lk ? load_chunk(src + j) : zero());
      }
    }
  });
}

// One row's scores s[0:width) for a chunk of keys, of which the first `visible` may be seen (none
// where visible <= 0): s becomes the weights exp(s * scale - max), bf16-rounded where RoundP and zero
// past `visible`; the running max and sum of weights take the chunk in, and the row's output o [D]
// is rescaled by how far the max rose.
template <bool RoundP>
void softmax_chunk_row(float* s, int64_t width, int64_t visible, float scale, float& running_max, float& sum,
                       float* o, int64_t d) {
  const float inf = std::numeric_limits<float>::infinity();
  VecF top = splat(-inf);
  for (int64_t n = 0; n < visible; n += kLanes) {
    const VecF t = mul(load_f32(s + n), splat(scale));
    store(s + n, t);
    top = max(top, select(lanes_below(visible - n), t, splat(-inf)));
  }
  const float chunk_max = visible > 0 ? hmax(top) : -inf;
  if (chunk_max > running_max) {
    if (sum != 0.f) {
      const float rescale = std::exp(running_max - chunk_max);
      sum *= rescale;
      for (int64_t j = 0; j < d; j += kLanes) store(o + j, mul(load_f32(o + j), splat(rescale)));
    }
    running_max = chunk_max;
  }
  const VecF m = splat(running_max);
  VecF total = zero();
  for (int64_t n = 0; n < width; n += kLanes) {
    if (n >= visible) {
      store(s + n, zero());
      continue;
    }
    const VecF p = keep(lanes_below(visible - n), exp_clamped(sub(load_f32(s + n), m)));
    total = add(total, p);
    store(s + n, RoundP ? bf16_round_trip(p) : p);
  }
  sum += hsum(total);
}

// Work item (KV head h, block of queries): the block's rows of out.
template <typename T>
void attend_query_block(const at::Tensor& q, const PrefillShape& s, const float* kp, const float* vp, int64_t h,
                        int64_t block, float scale, T* out) {
  thread_local std::vector<float> q_buffer, s_buffer, o_buffer, stats_buffer;
  const int64_t d = s.d, g = s.group, q0 = block * s.block_queries;
  const int64_t queries = std::min(s.block_queries, s.lq - q0), rows = queries * g;
  float* qr = scratch(q_buffer, rows * d);
  float* sr = scratch(s_buffer, rows * kKeyChunk);
  float* o = scratch(o_buffer, rows * d);
  float* running_max = scratch(stats_buffer, 2 * rows);
  float* sum = running_max + rows;
  const T* qd = q.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {  // row r: query q0 + r / g, head h g + r % g
    const T* src = qd + (q0 + r / g) * q.stride(0) + (h * g + r % g) * q.stride(1);
    for (int64_t j = 0; j < d; j += kLanes) {
      store(qr + r * d + j, load_chunk(src + j));
      store(o + r * d + j, zero());
    }
    running_max[r] = -std::numeric_limits<float>::infinity();
    sum[r] = 0.f;
  }
  const int64_t first_pos = s.lk - s.lq + q0, keys = first_pos + queries;
  const int64_t panels = s.lk_pad / kPanelCols;
  for (int64_t c0 = 0; c0 < keys; c0 += kKeyChunk) {
    const int64_t width = (std::min(kKeyChunk, keys - c0) + kPanelCols - 1) / kPanelCols * kPanelCols;
    for (int64_t n = 0; n < width; n += kPanelCols) {
      const float* panel = kp + (h * panels + (c0 + n) / kPanelCols) * d * kPanelCols;
      for (int64_t r = 0; r < rows; r += kPanelRows)
        panel_tile_rows(std::min<int64_t>(kPanelRows, rows - r), qr + r * d, d, panel, d, sr + r * kKeyChunk + n,
                        kKeyChunk, kPanelCols, false);
    }
    for (int64_t r = 0; r < rows; ++r)
      softmax_chunk_row<std::is_same_v<T, c10::BFloat16>>(sr + r * kKeyChunk, width,
                                                           std::min(width, first_pos + r / g + 1 - c0), scale,
                                                           running_max[r], sum[r], o + r * d, d);
    const float* values = vp + (h * s.lk_pad + c0) * d;
    for (int64_t j = 0; j < d; j += kPanelCols)
      for (int64_t r = 0; r < rows; r += kPanelRows)
        panel_tile_rows(std::min<int64_t>(kPanelRows, rows - r), sr + r * kKeyChunk, kKeyChunk, values + j, width,
                        o + r * d + j, d, kPanelCols, true, d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((q0 + r / g) * s.heads + h * g + r % g) * d;
    const VecF inv = splat(1.f / sum[r]);
    for (int64_t j = 0; j < d; j += kLanes) store_row_chunk(dst + j, mul(load_f32(o + r * d + j), inv));
  }
}

}  // namespace

at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && q.size(2) == k.size(2),
              "prefill_attention: q [Lq, H, D], k and v [Lk, KV, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "prefill_attention: q, k and v all float32 or all bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: head_dim must be contiguous");
  TORCH_CHECK(q.size(2) % kPanelCols == 0 && q.size(2) > 0, "prefill_attention: head_dim must be a multiple of ", kPanelCols);
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "prefill_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(k.size(0) >= q.size(0), "prefill_attention: fewer keys than queries");
  PrefillShape s{q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), q.size(1) / k.size(1), 0, 0};
  s.lk_pad = (s.lk + kPanelCols - 1) / kPanelCols * kPanelCols;
  s.block_queries = std::max<int64_t>(1, kAttentionRows / s.group);
  auto out = at::empty({s.lq, s.heads, s.d}, q.options());
  if (s.lq == 0) return out;
  // Not zeroed: every float is written by the packing.
  auto kp = at::empty({s.kv_heads, s.lk_pad, s.d}, q.options().dtype(at::kFloat));
  auto vp = at::empty({s.kv_heads, s.lk_pad, s.d}, q.options().dtype(at::kFloat));
  const int64_t blocks = (s.lq + s.block_queries - 1) / s.block_queries;
  const auto keys_of = [&](int64_t item) { return s.lk - s.lq + std::min(s.lq, (item % blocks + 1) * s.block_queries); };
  with_float_dtype(q.scalar_type(), "prefill_attention", [&](auto tag) {
    using T = decltype(tag);
    pack_keys_and_values<T>(k, v, s, kp.data_ptr<float>(), vp.data_ptr<float>());
    kestrel_parallel::parallel_for_by_cost(s.kv_heads * blocks, keys_of, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        attend_query_block<T>(q, s, kp.data_ptr<float>(), vp.data_ptr<float>(), i / blocks, i % blocks,
                              static_cast<float>(scale), out.data_ptr<T>());
    });
  });
  return out;
}

// ---- int8 linear layers (--quantization int8) without AMX ----
//
// linear_int8(x [M, K] bf16, qweight [N, K] int8, wscale [N] float32) -> y [M, N] bf16, any M, N and K:
// bit for bit kestrel/model/quantization.py's linear_int8_reference (and so cpu_gemv.cpp's
// linear_int8_amx where that runs). Each row of x is rotated by the orthonormal Hadamard transform on
// every block of 64 values where K % 64 == 0 (the butterflies in the reference's order), quantized
// per row (q = round_even(clamp(r * (127 / max|r|), -127, 127)), scale max|r| / 127), the int8
// products summed exactly in int32, and y[m, n] = (acc * wscale[n]) * xscale[m] rounded once to
// bf16. A row of x holding a NaN or an infinity quantizes to zeros with scale NaN, so its y row is
// NaN, as the reference's is.
//
// The exact int8 products: AVX512-VNNI's vpdpbusd multiplies u8 by s8, so each loaded weight vector
// is offset to u8 (w + 128, a xor of the sign bit) and every accumulator starts from -128 * sum(q)
// of its x row. AVX2 feeds |w| (u8) and x with w's sign (vpsignb) to vpmaddubsw, whose pair sums
// (at most 2 * 128 * 127) cannot saturate, then vpmaddwd sums the pairs into int32. An AVX-512 CPU
// without VNNI has no kernel here (int8_linear is false) and runs the reference.
//
// Decode (M of 1..64) streams the weights: a thread takes NR weight rows at a time and walks every
// block of MR rows of x against them while they sit in L1; the MR * NR <= kLanes int32 accumulators
// of a tile are summed across their lanes together into one vector, whose lanes the epilogue scales,
// rounds and stores. NR is kLanes at one row of x, kLanes / 2 at two and kLanes / 4 from three.

namespace {

#if defined(KESTREL_VEC_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KESTREL_INT8_LINEAR 1
constexpr int64_t kQBytes = 64;  // int8 values per vector
using QVec = __m512i;
struct WeightPiece {
  __m512i biased;  // w + 128 as u8
};
inline QVec load_q(const int8_t* p) { return _mm512_loadu_si512(p); }
inline QVec stream_q(const int8_t* p) { return _mm512_stream_load_si512(const_cast<int8_t*>(p)); }  // aligned
// Keeps a loaded vector in a register: folded into each vpdpbusd as a memory operand, x would be
// loaded NR times per step, and the loads, not the products, would set the pace.
inline QVec in_register_q(QVec v) {
  asm("" : "+v"(v));
  return v;
}
inline WeightPiece weight_piece(QVec w) { return {_mm512_xor_si512(w, _mm512_set1_epi8(-128))}; }
// acc += the four u8 x s8 products of each lane. Written as asm: through the intrinsic, GCC copied
// every accumulator to another register and back at each step (seen in GCC 12.2's output).
inline VecI dot_add(VecI acc, const WeightPiece& w, QVec x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w.biased), "v"(x));
  return acc;
}
inline int32_t accumulator_start(int32_t q_sum) { return -128 * q_sum; }
inline VecI first_lane(int32_t v) { return _mm512_maskz_set1_epi32(1, v); }
inline VecF to_float(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecF permute_lanes(VecF v, VecI idx) { return _mm512_permutexvar_ps(idx, v); }
inline VecI load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
inline VecI or_i(VecI a, VecI b) { return _mm512_or_si512(a, b); }
// Lanes rounded to int32 (to nearest even) and narrowed to int8 (values within [-127, 127]).
inline void store_int8(int8_t* p, VecF v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v))); }

// One vector whose lane i is the sum of a[i]'s lanes.
__attribute__((always_inline)) inline VecI sum_lanes(const VecI a[kLanes]) {
  VecI t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x88), _mm512_shuffle_i32x4(v[0], v[1], 0xDD));
}

// The Hadamard butterflies of strides 1, 2, 4 and 8, inside one register: lane i (bit h clear) and
// lane i + h become v[i] + v[i + h] and v[i] - v[i + h].
inline VecF butterflies_in_register(VecF v) {
  const auto step = [](VecF x, VecF partner, __mmask16 upper) {
    return _mm512_mask_blend_ps(upper, _mm512_add_ps(x, partner), _mm512_sub_ps(partner, x));
  };
  v = step(v, _mm512_permute_ps(v, 0xB1), 0xAAAA);
  v = step(v, _mm512_permute_ps(v, 0x4E), 0xCCCC);
  v = step(v, _mm512_shuffle_f32x4(v, v, 0xB1), 0xF0F0);
  return step(v, _mm512_shuffle_f32x4(v, v, 0x4E), 0xFF00);
}

#elif defined(KESTREL_VEC_AVX2)
#define KESTREL_INT8_LINEAR 1
constexpr int64_t kQBytes = 32;
using QVec = __m256i;
struct WeightPiece {
  __m256i w, magnitude;  // w, and |w| as u8 (|-128| is 128)
};
inline QVec load_q(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline QVec stream_q(const int8_t* p) { return _mm256_stream_load_si256((const __m256i*)p); }  // aligned
inline QVec in_register_q(QVec v) {
  asm("" : "+x"(v));
  return v;
}
inline WeightPiece weight_piece(QVec w) { return {w, _mm256_abs_epi8(w)}; }
inline VecI dot_add(VecI acc, const WeightPiece& w, QVec x) {
  const __m256i pairs = _mm256_maddubs_epi16(w.magnitude, _mm256_sign_epi8(x, w.w));  // |w| * (x * sign w)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline int32_t accumulator_start(int32_t) { return 0; }
inline VecI first_lane(int32_t v) { return _mm256_setr_epi32(v, 0, 0, 0, 0, 0, 0, 0); }
inline VecF to_float(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecF permute_lanes(VecF v, VecI idx) { return _mm256_permutevar8x32_ps(v, idx); }
inline VecI load_i(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline VecI or_i(VecI a, VecI b) { return _mm256_or_si256(a, b); }
inline void store_int8(int8_t* p, VecF v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w16, w16));
}

__attribute__((always_inline)) inline VecI sum_lanes(const VecI a[kLanes]) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

inline VecF butterflies_in_register(VecF v) {  // strides 1, 2 and 4
  v = _mm256_blend_ps(_mm256_add_ps(v, _mm256_permute_ps(v, 0xB1)), _mm256_sub_ps(_mm256_permute_ps(v, 0xB1), v), 0xAA);
  v = _mm256_blend_ps(_mm256_add_ps(v, _mm256_permute_ps(v, 0x4E)), _mm256_sub_ps(_mm256_permute_ps(v, 0x4E), v), 0xCC);
  const VecF partner = _mm256_permute2f128_ps(v, v, 0x01);
  return _mm256_blend_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), 0xF0);
}

#else
#define KESTREL_INT8_LINEAR 0
#endif

}  // namespace

#if KESTREL_INT8_LINEAR

namespace {

constexpr int kHadamardRegs = 64 / kLanes;

// The Walsh-Hadamard transform / 8 of 64 values in kHadamardRegs registers: strides 1, 2, 4, ...
// inside each register, then the larger ones across registers, in the order of the reference.
inline void hadamard64(VecF v[kHadamardRegs]) {
  for (int i = 0; i < kHadamardRegs; ++i) v[i] = butterflies_in_register(v[i]);
  for (int h = 1; h < kHadamardRegs; h *= 2)
    for (int i = 0; i < kHadamardRegs; ++i)
      if (!(i & h)) {
        const VecF a = v[i], b = v[i + h];
        v[i] = add(a, b);
        v[i + h] = sub(a, b);
      }
  for (int i = 0; i < kHadamardRegs; ++i) v[i] = mul(v[i], splat(0.125f));
}

// q = round_even(clamp(v * inv, -127, 127)), NaN (0 * inf, where max|r| is subnormal) to 0: the
// reference's round().clamp_().to(int8).
inline float quantized_level(float v, float inv) {
  const float s = v * inv;
  return std::isnan(s) ? 0.f : std::nearbyint(std::min(std::max(s, -127.f), 127.f));
}
inline VecF quantized_levels(VecF v, VecF inv) {
  const VecF s = mul(v, inv);
  return select(is_nan(s), zero(), min(max(s, splat(-127.f)), splat(127.f)));
}

// Row x (K bf16 values) as float32 into r, rotated where `rotate`; whether it is all finite, and
// max|r|. (vmaxps drops a NaN operand, so NaNs are looked for on their own.)
inline bool row_to_float(const uint16_t* x, int64_t K, bool rotate, float* r, float* absmax) {
  Mask nan = is_nan(zero());
  VecF amax = zero();
  const auto take = [&](VecF v) {
    nan = either(nan, is_nan(v));
    amax = max(amax, abs(v));
  };
  int64_t k = 0;
  if (rotate) {
    for (; k < K; k += 64) {
      VecF v[kHadamardRegs];
      for (int i = 0; i < kHadamardRegs; ++i) v[i] = load_bf16(x + k + i * kLanes);
      hadamard64(v);
      for (int i = 0; i < kHadamardRegs; ++i) {
        store(r + k + i * kLanes, v[i]);
        take(v[i]);
      }
    }
  } else {
    for (; k + kLanes <= K; k += kLanes) {
      const VecF v = load_bf16(x + k);
      store(r + k, v);
      take(v);
    }
  }
  float m = hmax(amax);
  bool finite = !any(nan);
  for (; k < K; ++k) {
    r[k] = bf16_bits_to_float(x[k]);
    finite = finite && !std::isnan(r[k]);
    m = std::max(m, std::fabs(r[k]));
  }
  *absmax = m;
  return finite && !std::isinf(m);
}

// One row of x rotated (where `rotate`) and quantized into q (kp >= K values, zeros past K); its
// scale, and the sum of its levels into *q_sum. `r`: room for K floats.
inline float quantize_x_row(const uint16_t* x, int64_t K, bool rotate, float* r, int8_t* q, int64_t kp,
                            int32_t* q_sum) {
  float absmax;
  if (!row_to_float(x, K, rotate, r, &absmax)) {
    std::memset(q, 0, kp);
    *q_sum = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  const VecF inv_v = splat(inv);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) store_int8(q + k, quantized_levels(load_f32(r + k), inv_v));
  for (; k < K; ++k) q[k] = static_cast<int8_t>(quantized_level(r[k], inv));
  std::memset(q + K, 0, kp - K);
  int32_t sum = 0;
  for (int64_t i = 0; i < K; ++i) sum += q[i];
  *q_sum = sum;
  return absmax / 127.f;
}

// x quantized, rows of kp (K rounded up to whole vectors) zero-padded int8 levels, with each row's
// scale and accumulator start. One buffer per calling thread, kept and grown: an allocation per call
// would cost about as much as a small product. Rows start on 64-byte lines: a vector load across two
// lines costs two.
struct QuantizedX {
  int8_t* q;
  float* scale;
  int32_t* start;
  int64_t kp;
  QuantizedX(const uint16_t* x, int64_t M, int64_t K) : kp((K + kQBytes - 1) / kQBytes * kQBytes) {
    thread_local std::vector<int8_t> levels;
    thread_local std::vector<float> scales;
    thread_local std::vector<int32_t> starts;
    if ((int64_t)levels.size() < M * kp + 64) levels.resize(M * kp + 64);
    if ((int64_t)scales.size() < M) scales.resize(M), starts.resize(M);
    q = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(levels.data()) + 63) & ~uintptr_t(63));
    scale = scales.data();
    start = starts.data();
    const bool rotate = K % 64 == 0;
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
      std::vector<float> rotated(K);
      for (int64_t m = begin; m < end; ++m) {
        int32_t sum;
        scale[m] = quantize_x_row(x + m * K, K, rotate, rotated.data(), q + m * kp, kp, &sum);
        start[m] = accumulator_start(sum);
      }
    });
  }
};

struct Int8Operands {
  const QuantizedX& x;
  const int8_t* w;
  const float* wscale;
  uint16_t* y;
  int64_t M, N, K;
};

// Lane i of a tile's vector holds (x row i / NR, weight row i % NR): the lanes' rows and columns.
struct TileLanes {
  VecI row, col;
  explicit TileLanes(int nr) {
    alignas(64) int32_t r[kLanes], c[kLanes];
    for (int i = 0; i < kLanes; ++i) r[i] = i / nr, c[i] = i % nr;
    row = load_i(r);
    col = load_i(c);
  }
};

// The MR x NR tile of y at rows m0.., columns n0.. (rows and columns past M and N are computed
// from clamped rows and not stored). `wscale_lanes`: wscale of each lane's column.
// The weight rows of a tile: where K is not whole vectors, `tail` holds each row's last part,
// zero-padded to a vector (read in place of the row's end, which a vector load would overrun).
template <int NR>
struct WeightRows {
  const int8_t* row[NR];
  const int8_t* tail[NR];
  alignas(64) int8_t tail_values[NR][kQBytes];
  WeightRows(const Int8Operands& op, int64_t n0) {
    const int64_t whole = op.K / kQBytes * kQBytes;
    for (int n = 0; n < NR; ++n) {
      row[n] = op.w + std::min(n0 + n, op.N - 1) * op.K;
      tail[n] = tail_values[n];
      if (whole < op.K) {
        std::memset(tail_values[n], 0, kQBytes);
        std::memcpy(tail_values[n], row[n] + whole, op.K - whole);
      }
    }
  }
};

// How far ahead of the weight row being read (two rows of x, or one where the weights are not aligned
// for non-temporal loads) its stream is fetched into L2.
// Reading 64 bytes of each of a tile's NR rows in turn instead (NR strided streams, nothing fetched
// ahead) took 1.6-1.8x as long over the default model's projections at one row on 2 Zen 4 cores.
constexpr int64_t kInt8StreamAheadBytes = 2048;

// Stream (one row of x, the weights aligned and K a multiple of kQBytes): the weights read by
// non-temporal loads, as cpu_gemv.cpp's load_weights, which leave the caches to the rest of the step.
template <int MR, int NR, bool Stream = false>
inline void int8_tile(const Int8Operands& op, const TileLanes& lanes, const WeightRows<NR>& w_rows, int64_t m0,
                      int64_t n0, VecF wscale_lanes) {
  static_assert(MR * NR <= kLanes, "one vector of sums per tile");
  static_assert(MR <= 2 || !Stream, "more rows read several weight rows side by side");
  const int64_t kp = op.x.kp, K = op.K;
  const int8_t* x_rows[MR];
  VecI acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    const int64_t row = std::min(m0 + m, op.M - 1);
    x_rows[m] = op.x.q + row * kp;
    for (int n = 0; n < NR; ++n) acc[m][n] = first_lane(op.x.start[row]);
  }
  if constexpr (MR <= 2) {
    // One or two rows of x: each weight row read to its end before the next, so that a thread's weights
    // are one sequential stream (int32 sums: the order changes nothing). See kInt8StreamAheadBytes.
    for (int n = 0; n < NR; ++n)
      for (int64_t k = 0; k < kp; k += kQBytes) {
        QVec wq;
        if constexpr (Stream) {
          wq = stream_q(w_rows.row[n] + k);  // no tail: K is a multiple of kQBytes
        } else {
          const bool tail = k + kQBytes > K;
          const int8_t* w = tail ? w_rows.tail[n] : w_rows.row[n] + k;
          if (!tail) _mm_prefetch(reinterpret_cast<const char*>(w + kInt8StreamAheadBytes), _MM_HINT_T1);
          wq = load_q(w);
        }
        const WeightPiece piece = weight_piece(wq);
        for (int m = 0; m < MR; ++m) acc[m][n] = dot_add(acc[m][n], piece, load_q(x_rows[m] + k));
      }
  } else {
    for (int64_t k = 0; k < kp; k += kQBytes) {  // x is zero-padded to kp
      const int8_t* const* w = w_rows.row;
      int64_t wk = k;
      if (k + kQBytes > K) w = w_rows.tail, wk = 0;
      // The first block of x rows fetches the same piece of the next NR weight rows (they follow these
      // in memory; past the last, a prefetch is dropped harmlessly).
      if (m0 == 0 && wk == k)
        for (int n = 0; n < NR; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(w_rows.row[n] + NR * K + k), _MM_HINT_T1);
      QVec xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = in_register_q(load_q(x_rows[m] + k));
      for (int n = 0; n < NR; ++n) {
        const WeightPiece piece = weight_piece(load_q(w[n] + wk));
        for (int m = 0; m < MR; ++m) acc[m][n] = dot_add(acc[m][n], piece, xv[m]);
      }
    }
  }
  VecI sums[kLanes];
  for (int i = 0; i < kLanes; ++i) sums[i] = i < MR * NR ? acc[i / NR][i % NR] : splat_i(0);
  const VecF xscale_lanes = permute_lanes(load_first(op.x.scale + m0, op.M - m0), lanes.row);
  const VecF v = mul(mul(to_float(sum_lanes(sums)), wscale_lanes), xscale_lanes);  // two roundings, as the reference
  // bf16 to nearest even; a NaN stays a quiet NaN
  const VecI nan_bits = or_i(bits(v), splat_i(0x00400000));
  alignas(64) int32_t out[kLanes];
  store_i(out, select_i(is_nan(v), nan_bits, round_to_bf16_upper(v)));
  const int rows = (int)std::min<int64_t>(MR, op.M - m0), cols = (int)std::min<int64_t>(NR, op.N - n0);
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < cols; ++n) op.y[(m0 + m) * op.N + n0 + n] = static_cast<uint16_t>(out[m * NR + n] >> 16);
}

// Every row of x against weight rows n0 .. n0 + NR: blocks of MR = kLanes / NR rows, then the rest.
template <int NR, bool Stream = false>
inline void int8_columns(const Int8Operands& op, const TileLanes& lanes, int64_t n0) {
  constexpr int MR = kLanes / NR;
  const WeightRows<NR> w_rows(op, n0);
  const VecF wscale_lanes = permute_lanes(load_first(op.wscale + n0, op.N - n0), lanes.col);
  int64_t m0 = 0;
  for (; m0 + MR <= op.M; m0 += MR) int8_tile<MR, NR, Stream>(op, lanes, w_rows, m0, n0, wscale_lanes);
  if constexpr (MR >= 4) {
    if (op.M - m0 == 3) int8_tile<3, NR>(op, lanes, w_rows, m0, n0, wscale_lanes);
  }
  if constexpr (MR >= 3) {
    if (op.M - m0 == 2) int8_tile<2, NR>(op, lanes, w_rows, m0, n0, wscale_lanes);
  }
  if constexpr (MR >= 2) {
    if (op.M - m0 == 1) int8_tile<1, NR>(op, lanes, w_rows, m0, n0, wscale_lanes);
  }
}

template <int NR, bool Stream = false>
void int8_run(const Int8Operands& op) {
  const int64_t groups = (op.N + NR - 1) / NR;
  // Grain: about 32 KB of weights per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / (NR * std::max<int64_t>(op.K, 1)));
  const TileLanes lanes(NR);
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) int8_columns<NR, Stream>(op, lanes, g * NR);
  });
}

}  // namespace

at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor wscale) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && wscale.dim() == 1, "linear_int8: x and qweight 2-D, wscale 1-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int8: x must be bf16");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && wscale.scalar_type() == at::kFloat,
              "linear_int8: qweight must be int8 and wscale float32");
  TORCH_CHECK(x.size(1) == qweight.size(1), "linear_int8: x and qweight disagree on K");
  TORCH_CHECK(wscale.size(0) == qweight.size(0), "linear_int8: wscale needs one scale per row of qweight");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= std::numeric_limits<int32_t>::max() / (127 * 127),
              "linear_int8: K must be 1 .. 2^31 / 127^2 (int32 sums)");
  TORCH_CHECK(qweight.is_contiguous() && wscale.is_contiguous(), "linear_int8: qweight and wscale must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), N = qweight.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedX xq(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K);
  const Int8Operands op{xq, qweight.data_ptr<int8_t>(), wscale.data_ptr<float>(),
                        reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, N, K};
  // One row reads each weight row once, to its end: by non-temporal loads where every row is aligned
  // for them. (At 2 rows they ran 1.1-1.2x slower on the AVX2 build, W6's shapes from memory.)
  const bool stream = reinterpret_cast<uintptr_t>(op.w) % kQBytes == 0 && K % kQBytes == 0;
  if (M == 1) stream ? int8_run<kLanes, true>(op) : int8_run<kLanes>(op);
  else if (M == 2) int8_run<kLanes / 2>(op);
  else int8_run<kLanes / 4>(op);
  return y;
}

#else
at::Tensor linear_int8(at::Tensor, at::Tensor, at::Tensor) {
  TORCH_CHECK(false, "linear_int8: this build has no int8 kernel (AVX-512 without VNNI)");
}
#endif

// ---- the decode plan's layer loop ----

// The matmuls DecodeLayers calls (matmul_fn.h): linear_f32 here, or a bf16 kernel of cpu_gemv.cpp, and
// for a bf16 batch of 1..15 rows cpu_gemv's per-thread share of one.
using kestrel_matmul::MatmulFn;
using kestrel_matmul::MatmulSliceFn;

at::Tensor linear_f32_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_f32(x, w); }
at::Tensor linear_bf16_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_bf16(x, w, false); }
at::Tensor linear_gguf_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_gguf(x, w, false); }

// A projection's output features: w [N, K], or a packed bf16 weight [N / 16, K, 16].
inline int64_t out_features(const at::Tensor& w) { return w.dim() == 3 ? w.size(0) * w.size(2) : w.size(0); }

// The first error of a region's threads.
struct RegionError {
  std::atomic<bool> raised{false};
  std::exception_ptr error;
};

// The threads of one parallel region, walking a layer's phases in step: a matmul phase gives each
// thread its share of the output columns, a serial phase runs on thread 0 (the small row-wise kernels,
// whose own at::parallel_for runs inline inside a region); a barrier ends each phase. A serial phase
// that throws stops the work of every later phase (the barriers still meet) and the error is
// rethrown once the region has ended: nothing may leave an OpenMP region by an exception.
class Team {
 public:
  Team(int thread, int threads, RegionError& error) : thread_(thread), threads_(threads), error_(error) {}

  template <typename F>
  void serial(const F& f) {
    if (thread_ == 0) guarded(f);
#pragma omp barrier
  }

  // y = x w^T by the slice matmul.
  void matmul(MatmulSliceFn slice, const at::Tensor& x, const at::Tensor& w, const at::Tensor& y) {
    guarded([&] {
      const int64_t N = out_features(w);
      const auto [begin, end] = share(N);
      if (begin < end) slice(bits(x), bits(w), bits(y), x.size(0), N, w.size(1), begin, end);
    });
#pragma omp barrier
  }

 private:
  template <typename F>
  void guarded(const F& f) {
    if (error_.raised.load()) return;
    try {
      f();
    } catch (...) {
#pragma omp critical(kestrel_region_error)
      if (!error_.raised.exchange(true)) error_.error = std::current_exception();
    }
  }

  static uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); }

  // This thread's output columns of N: whole blocks of kSliceColumns, as even as they go.
  std::pair<int64_t, int64_t> share(int64_t N) const {
    const int64_t blocks = (N + kestrel_matmul::kSliceColumns - 1) / kestrel_matmul::kSliceColumns;
    const int64_t b0 = blocks * thread_ / threads_, b1 = blocks * (thread_ + 1) / threads_;
    return {b0 * kestrel_matmul::kSliceColumns, std::min(N, b1 * kestrel_matmul::kSliceColumns)};
  }

  int thread_, threads_;
  RegionError& error_;
};

// f(team) on every thread of one OpenMP region (the same threads as at::parallel_for's).
template <typename F>
void in_one_region(const F& f) {
  RegionError error;
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    Team team(omp_get_thread_num(), omp_get_num_threads(), error);
    f(team);
  }
  if (error.raised.load()) std::rethrow_exception(error.error);
}

// The layer loop of kestrel/model/decode_plan.py for a Llama-family model without q/k norms or biases,
// on the model-dtype cache, in C++: the same kernels in the same order on the same tensors (the matmul
// the plan binds, by its address), so its hidden states are bit-identical to the Python loop's (and so
// to the model's forward). What it saves is the Python between the ~300 kernel calls of a step:
// ~1.5-2 ms of a ~27 ms batch-1 step on 2 AVX2 cores (float32), ~0.3 ms of a ~11.5 ms one on 2 Zen 4
// cores (bf16; interleaved A/B, BENCHMARKS.md).
//
// With a slice matmul (bf16, 1..15 rows) a layer runs in three parallel regions instead of ~6: the
// attention's two (its own kernel, as in the loop above), and one from the o projection through the
// next layer's qkv projection and rotary write, in which each thread computes its share of each
// projection and the small kernels run on thread 0 between barriers: the threads no longer fork and
// join around every kernel. The serial phases call the same kernels, and the shares sum every output
// as the whole matmul does, so the results stay bit-identical. Measured on 2 Zen 4 cores (in-process,
// interleaved): -0.1 to -0.5 ms of a ~12 ms batch-1 step, -0.6 ms of an ~18 ms step of 8 rows.
// (Prefetching the start of each thread's next share across the barrier measured nothing.)
class DecodeLayers {
 public:
  // weights: 6 per layer (input norm, qkv, o, post-attention norm, gate_up, down), the norms in the
  // model's dtype, the projections in one dtype (the model's, or uint8: packed GGUF blocks); caches: k, v
  // per layer, each [num_slots, kv_heads, head_dim]; matmul_address: a MatmulFn for the projections;
  // slice_address: its MatmulSliceFn for 1..15 rows (bf16 only; for packed weights, the packed one), or 0.
  // The projections are all [N, K] or all packed ([N / 16, K, 16] bf16, or linear_gguf's layout).
  DecodeLayers(std::vector<at::Tensor> weights, std::vector<at::Tensor> caches, int64_t heads,
               double eps, double scale, int64_t matmul_address, int64_t slice_address)
      : weights_(std::move(weights)), caches_(std::move(caches)), heads_(heads), eps_(eps), scale_(scale),
        matmul_(reinterpret_cast<MatmulFn>(matmul_address)), slice_(reinterpret_cast<MatmulSliceFn>(slice_address)) {
    TORCH_CHECK(weights_.size() % 6 == 0 && caches_.size() * 3 == weights_.size(),
                "DecodeLayers: 6 weights and 2 caches per layer");
    TORCH_CHECK(matmul_ != nullptr, "DecodeLayers: no matmul");
    for (size_t i = 0; i < weights_.size(); ++i)  // the norms in one dtype, the projections in one
      TORCH_CHECK(weights_[i].scalar_type() == weights_[i % 6 == 0 || i % 6 == 3 ? 0 : 1].scalar_type() &&
                  weights_[i].is_contiguous(), "DecodeLayers: contiguous norms of one dtype, projections of one");
    TORCH_CHECK(slice_ == nullptr || weights_.empty() || weights_[1].scalar_type() == at::kBFloat16,
                "DecodeLayers: a slice matmul takes bf16 weights");
    for (size_t i = 0; i < weights_.size(); ++i)
      TORCH_CHECK(i % 6 == 0 || i % 6 == 3 || weights_[i].dim() == weights_[1].dim(),
                  "DecodeLayers: the projections are all packed or none is");
  }

  // x [n, hidden]: the embedded tokens. Returns the hidden states before the final norm.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                     at::Tensor table, at::Tensor seq_lens, int64_t block_size) const {
    if (slice_ != nullptr && x.size(0) < kestrel_matmul::kSliceMaxRows && !caches_.empty())
      return forward_in_regions(x, cos, sin, slots, table, seq_lens, block_size);
    const int64_t n = x.size(0), layers = static_cast<int64_t>(caches_.size() / 2);
    at::Tensor residual, h;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights_.data() + 6 * l;
      const at::Tensor &k_cache = caches_[2 * l], &v_cache = caches_[2 * l + 1];
      if (!residual.defined()) {
        residual = x;
        h = rms_norm(x, c10::nullopt, w[0], eps_);
      } else {
        h = rms_norm(x, residual, w[0], eps_);  // residual += x, in place
      }
      const int64_t head_dim = k_cache.size(2), kv_heads = k_cache.size(1);
      at::Tensor qkv = matmul_(h, w[1]).view({n, heads_ + 2 * kv_heads, head_dim});
      rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads_);
      at::Tensor out = paged_decode_attention(qkv.slice(1, 0, heads_), k_cache, v_cache, table, seq_lens,
                                              block_size, scale_, true);
      h = rms_norm(matmul_(out.view({n, heads_ * head_dim}), w[2]), residual, w[3], eps_);
      x = matmul_(silu_and_mul(matmul_(h, w[4])), w[5]);
    }
    return at::add(x, residual);
  }

 private:
  // The loop above for 1..15 rows on the slice matmul, a layer in three parallel regions (see the class).
  at::Tensor forward_in_regions(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& slots, const at::Tensor& table,
                                const at::Tensor& seq_lens, int64_t block_size) const {
    const int64_t n = x.size(0), layers = static_cast<int64_t>(caches_.size() / 2);
    const int64_t head_dim = caches_[0].size(2), kv_heads = caches_[0].size(1);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2 &&
                x.size(1) == weights_[1].size(1), "DecodeLayers: x must be contiguous bf16 [n, hidden]");
    const auto w = [&](int64_t l, int i) -> const at::Tensor& { return weights_[6 * l + i]; };
    at::Tensor residual = x, h, act;
    at::Tensor qkv = at::empty({n, out_features(w(0, 1))}, x.options());
    at::Tensor o = at::empty({n, out_features(w(0, 2))}, x.options());
    at::Tensor gate_up = at::empty({n, out_features(w(0, 4))}, x.options());
    at::Tensor down = at::empty({n, out_features(w(0, 5))}, x.options());
    const auto qkv_heads = qkv.view({n, heads_ + 2 * kv_heads, head_dim});
    // The first layer's input norm, qkv projection and rotary write; each region below ends with the
    // next layer's.
    const auto into_qkv = [&](Team& team, int64_t l) {
      team.matmul(slice_, h, w(l, 1), qkv);
      team.serial([&] { rotary_write_kv(qkv_heads, cos, sin, caches_[2 * l], caches_[2 * l + 1], slots, heads_); });
    };
    in_one_region([&](Team& team) {
      team.serial([&] { h = rms_norm(x, c10::nullopt, w(0, 0), eps_); });
      into_qkv(team, 0);
    });
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor out = paged_decode_attention(qkv_heads.slice(1, 0, heads_), caches_[2 * l],
                                                    caches_[2 * l + 1], table, seq_lens, block_size, scale_, true)
                                    .view({n, heads_ * head_dim});
      const bool last = l + 1 == layers;
      in_one_region([&](Team& team) {
        team.matmul(slice_, out, w(l, 2), o);
        team.serial([&] { h = rms_norm(o, residual, w(l, 3), eps_); });  // residual += o, in place
        team.matmul(slice_, h, w(l, 4), gate_up);
        team.serial([&] { act = silu_and_mul(gate_up); });
        team.matmul(slice_, act, w(l, 5), down);
        if (!last) {
          team.serial([&] { h = rms_norm(down, residual, w(l + 1, 0), eps_); });  // residual += down
          into_qkv(team, l + 1);
        }
      });
    }
    return at::add(down, residual);
  }

  std::vector<at::Tensor> weights_, caches_;
  int64_t heads_;
  double eps_, scale_;
  MatmulFn matmul_;
  MatmulSliceFn slice_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("lanes") = kLanes;  // the vector width this build was compiled for (16: AVX-512, 8: AVX2)
  m.attr("panel_columns") = kPanelCols;  // the columns of a packed bf16 weight's panel
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) for float32 [rows, n] (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add (CPU)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("in_q_dtype") = false);
  m.def("rotary_write_kv", &rotary_write_kv, "rotary embedding in place, fused with the KV-cache write (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("num_heads"));
  m.def("rotary_write_kv_int8", &rotary_write_kv_int8, "rotary_write_kv into the int8 KV cache (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_t"), py::arg("k_scale"), py::arg("v"),
        py::arg("v_scale"), py::arg("slot_mapping"), py::arg("num_heads"));
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8, "decode attention over the int8 KV cache (CPU)",
        py::arg("q"), py::arg("k_t"), py::arg("k_scale"), py::arg("v"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"), py::arg("in_q_dtype") = false);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a chunk of queries (the last Lq positions) over its keys, float32 or bf16 (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"));
  m.def("supports", &supports, "whether a (head_dim, group) pair has a kernel");
  m.def("linear_f32", &linear_f32, "x w^T in float32 for decode-sized batches (CPU)");
  m.attr("int8_linear") = bool(KESTREL_INT8_LINEAR);  // whether linear_int8 runs in this build
  m.def("linear_int8", &linear_int8,
        "y = x w^T, bf16 x quantized per row to int8, w int8 with a float32 scale per row; y bf16 (CPU, "
        "AVX512-VNNI or AVX2)", py::arg("x"), py::arg("qweight"), py::arg("wscale"));
  m.def("linear_bf16", &linear_bf16,
        "y = x w^T for bf16 x and w ([N, K], or packed [N / 16, K, 16]), any rows (CPU, without AVX512-BF16); "
        "float_out: y in float32, unrounded",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
  m.def("linear_gguf", &linear_gguf,
        "y = x w^T for bf16 x and GGUF Q8_0 / Q6_K / Q4_K / Q4_1 / Q5 weights packed by dispatch.py's pack_gguf_weight, "
        "any rows (CPU); float_out: y in float32, unrounded",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
  m.def("matmul_address", [](const std::string& name) -> int64_t {
    if (name == "linear_bf16") return reinterpret_cast<int64_t>(&linear_bf16_matmul);
    if (name == "linear_gguf") return reinterpret_cast<int64_t>(&linear_gguf_matmul);
    TORCH_CHECK(name == "linear_f32", "matmul_address: no matmul ", name);
    return reinterpret_cast<int64_t>(&linear_f32_matmul);
  }, "the address of a matmul as a MatmulFn, for DecodeLayers", py::arg("name"));
  m.def("matmul_slice_address", [](const std::string& name) -> int64_t {
    if (name == "linear_bf16_packed") return reinterpret_cast<int64_t>(&linear_bf16_slice<true>);
    TORCH_CHECK(name == "linear_bf16", "matmul_slice_address: no slice of ", name);
    return reinterpret_cast<int64_t>(&linear_bf16_slice<false>);
  }, "the address of one thread's share of a matmul (1..15 rows) as a MatmulSliceFn, for DecodeLayers",
        py::arg("name"));
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, double, double, int64_t,
                    int64_t>(),
           py::arg("weights"), py::arg("caches"), py::arg("heads"), py::arg("eps"), py::arg("scale"),
           py::arg("matmul_address"), py::arg("slice_address") = 0)
      .def("__call__", &DecodeLayers::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("table"), py::arg("seq_lens"), py::arg("block_size"));
}
