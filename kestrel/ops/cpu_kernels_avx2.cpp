// Kestrel's CPU kernels for AVX2 + FMA machines without AVX-512 (most laptops and desktops, AMD Zen
// 1-3): the same Python interface as cpu_kernels.cpp for float32 or bf16 storage, float32 math, in
// 8-lane vectors, and the int8 KV cache's (rotary_write_kv_int8, paged_decode_attention_int8).
// kestrel/ops/__init__.py loads this file where the CPU has AVX2 and FMA but no AVX-512. Not here:
// AMX (the matmuls are torch's, or linear_f32 below). A separate file rather than a second
// instruction set inside cpu_kernels.cpp: a machine runs only one of the two, so a change to one can
// never be tested by the other's machine.
// Their PyTorch references live in kestrel/model/attention.py and kestrel/model/layers.py;
// tests/test_cpu_kernels.py compares whichever file this CPU builds.
//
// paged_decode_attention: one query token per sequence, grouped-query heads, read straight from the
// paged KV cache with no gathered copy. Work is cut into (sequence, KV head, segment) items, a
// segment being up to kSegmentTokens keys, so that a batch of one still spreads over the threads;
// each item reads its K and V rows once for all the G query heads that share them (scores, softmax,
// then the V rows, in registers), and the items of a sequence cut into segments are merged after
// the parallel loop (running max, sum of exponentials, unnormalised output).
// rms_norm (optionally fused with the residual add), silu_and_mul, rotary_write_kv and argmax_rows:
// one pass over each row, as in cpu_kernels.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include "int8_kv.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "this kernel needs AVX2 and FMA; kestrel falls back to the PyTorch path elsewhere"
#endif

namespace {

using kestrel_parallel::parallel_for_by_cost;

constexpr int kLanes = 8;
using VecF = __m256;

inline VecF load_f32(const float* p) { return _mm256_loadu_ps(p); }
inline VecF load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline VecF load_chunk(const float* p) { return load_f32(p); }
inline VecF load_chunk(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF zero() { return _mm256_setzero_ps(); }
inline VecF splat(float x) { return _mm256_set1_ps(x); }
inline void store(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline float hsum(VecF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x), x clamped to [-87, 88]: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6
// polynomial (relative error ~2e-7); n in [-126, 127], so 2^n is built straight in the exponent field.
inline VecF exp_clamped(VecF x) {
  x = _mm256_min_ps(_mm256_max_ps(x, splat(-87.f)), splat(88.f));
  const VecF t = _mm256_mul_ps(x, splat(1.44269504088896341f));
  const VecF n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VecF f = _mm256_mul_ps(_mm256_sub_ps(t, n), splat(0.693147180559945309f));  // f ln 2
  VecF p = splat(1.f / 720);
  p = fma(p, f, splat(1.f / 120));
  p = fma(p, f, splat(1.f / 24));
  p = fma(p, f, splat(1.f / 6));
  p = fma(p, f, splat(0.5f));
  p = fma(p, f, splat(1.f));
  p = fma(p, f, splat(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// float → bf16 with round-to-nearest-even, as torch's .to(torch.bfloat16) does: the bf16 value sits
// in the upper 16 bits of each lane of the result.
inline __m256i round_to_bf16_bits(VecF v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
}
inline void store_row_chunk(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline void store_row_chunk(c10::BFloat16* p, VecF v) {
  const __m256i h = _mm256_srli_epi32(round_to_bf16_bits(v), 16);  // each lane < 2^16: packus is exact
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

// ---- paged decode attention ----

constexpr int64_t kSegmentTokens = 256;  // keys per work item: a batch of one still fills the threads

template <int D, int G>
struct Partial {
  float m[G], l[G];
  float acc[G][D];  // unnormalised
};

// Query heads scored together: up to 3, so that their accumulators for 4 keys (12) and the 4 key
// vectors fit the 16 registers; G is split evenly into such chunks.
template <int G>
constexpr int kHeadChunk = G % 3 == 0 ? 3 : (G % 2 == 0 ? 2 : 1);

// [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums in 3 hadds and one add.
inline __m128 hsum4(VecF a0, VecF a1, VecF a2, VecF a3) {
  const VecF t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

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
// a stride, loses the stream at every block edge: measured, 64 sequences' attention read the cache at
// 11 GB/s against a 28 GB/s streaming read. The score loop therefore prefetches the K and V rows
// kPrefetchKeys keys ahead (V is read by the P V pass right after, from L2).
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

// Item (s, h, segment [t0, t1)) → its partial result. q rows float32, pre-scaled by the caller;
// `rows` holds the segment's cache row offsets (token slot × stride).
template <typename T, int D, int G>
void attend_segment(const float* q, const T* kp, const T* vp, const std::vector<int64_t>& rows, int64_t n,
                    std::vector<float>& scores, Partial<D, G>& out) {
  constexpr int C = D / kLanes, JC = kHeadChunk<G>, CC = C < 4 ? C : 4;
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(G * padded);
  for (int j0 = 0; j0 < G; j0 += JC) {
    __m128 mx4[JC];
    for (int j = 0; j < JC; ++j) mx4[j] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      if (j0 == 0) prefetch_rows(kp, vp, rows, t + kPrefetchKeys, std::min(n, t + kPrefetchKeys + 4), D * sizeof(T));
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
        VecF acc = _mm256_mul_ps(load_f32(q + (j0 + j) * D), load_chunk(row));
        for (int c = 1; c < C; ++c) acc = fma(load_f32(q + (j0 + j) * D + c * kLanes), load_chunk(row + c * kLanes), acc);
        const float sc = hsum(acc);
        scores[(j0 + j) * padded + u] = sc;
        mx = std::max(mx, sc);
      }
      out.m[j0 + j] = mx;
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int j = 0; j < G; ++j) {
    float* sj = scores.data() + j * padded;
    const VecF m = splat(out.m[j]);
    VecF sum = zero();
    for (int64_t i = 0; i < padded; i += kLanes) {
      // Lanes past the segment's end are zeroed: they hold no score.
      const VecF valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), lane));
      const VecF e = _mm256_and_ps(exp_clamped(_mm256_sub_ps(load_f32(sj + i), m)), valid);
      store(sj + i, e);
      sum = _mm256_add_ps(sum, e);
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
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
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
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> rows(kSegmentTokens);
    alignas(32) float qs[G * D];
    int64_t s = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[s + 1]) ++s;
      const int64_t local = item - first_item[s], seg = local / kv_heads, h = local % kv_heads;
      const float* qrow = qp + (s * num_heads + h * G) * D;
      for (int i = 0; i < G * D; i += kLanes) store(qs + i, _mm256_mul_ps(load_f32(qrow + i), splat(scale)));
      const int64_t t0 = seg * kSegmentTokens, t1 = std::min(lens[s], t0 + kSegmentTokens);
      const int64_t* table = tables + s * max_blocks;
      // Row offsets walk the block table without a division per key (one costs ~10 ns here).
      for (int64_t t = t0, b = t0 / block_size, off = t0 % block_size; t < t1; ++t) {
        rows[t - t0] = (table[b] * block_size + off) * stride;
        if (++off == block_size) off = 0, ++b;
      }
      attend_segment<T, D, G>(qs, kp + h * D, vp + h * D, rows, t1 - t0, scores, parts[item]);
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
        for (int c = 0; c < D / kLanes; ++c) store(dst + c * kLanes, _mm256_mul_ps(acc[c], splat(1.f / sum)));
      }
    }
  });
}

// A decode kernel's float32 result, rounded once to `dtype` (bf16, round to nearest even, as .to()
// rounds) or returned as is.
torch::Tensor in_dtype(const torch::Tensor& out, c10::ScalarType dtype) {
  if (dtype == torch::kFloat32) return out;
  TORCH_CHECK(dtype == torch::kBFloat16, "q must be float32 or bfloat16");
  auto rounded = torch::empty(out.sizes(), out.options().dtype(torch::kBFloat16));
  const float* src = out.data_ptr<float>();
  c10::BFloat16* dst = rounded.data_ptr<c10::BFloat16>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) dst[i] = c10::BFloat16(src[i]);
  return rounded;
}

}  // namespace

// q [num_seqs, num_heads, head_dim] float32 or bfloat16; k_cache, v_cache [num_slots, kv_heads, head_dim] float32 or
// bfloat16; block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs] int64 (keys 0..len-1 visible).
// Returns [num_seqs, num_heads, head_dim]: float32, or with `in_q_dtype` q's dtype (see in_dtype).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     int64_t block_size, double scale, bool in_q_dtype) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == torch::kFloat32, "the KV cache must be float32 or bfloat16");
  const auto q_dtype = q.scalar_type();
  auto out = torch::empty(q.sizes(), q.options().dtype(torch::kFloat32));
  q = q.to(torch::kFloat32).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t d = q.size(2), g = q.size(1) / k_cache.size(1);
  const float sc = static_cast<float>(scale);
#define KESTREL_CASE(D, G)                                                                              \
  if (d == D && g == G) {                                                                               \
    if (bf16) run<c10::BFloat16, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc); \
    else run<float, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc);             \
    return in_q_dtype ? in_dtype(out, q_dtype) : out;                                                   \
  }
  KESTREL_CASE(64, 1) KESTREL_CASE(64, 2) KESTREL_CASE(64, 3) KESTREL_CASE(64, 4)
  KESTREL_CASE(64, 5) KESTREL_CASE(64, 8)
  KESTREL_CASE(128, 1) KESTREL_CASE(128, 2) KESTREL_CASE(128, 4) KESTREL_CASE(128, 8)
#undef KESTREL_CASE
  TORCH_CHECK(false, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return out;
}

bool supports(int64_t head_dim, int64_t group) {
  const int64_t ok[][2] = {{64, 1}, {64, 2}, {64, 3}, {64, 4}, {64, 5}, {64, 8}, {128, 1}, {128, 2}, {128, 4}, {128, 8}};
  for (const auto& c : ok)
    if (c[0] == head_dim && c[1] == group) return true;
  return false;
}

// ---- elementwise kernels for the layer: RMSNorm (with the residual add fused) and SiLU-and-mul ----

namespace {

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                   torch::Tensor& out, double eps) {
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
          store_row_chunk(rp + r * hidden + i, _mm256_add_ps(v, load_chunk(rp + r * hidden + i)));
          v = load_chunk(rp + r * hidden + i);
        }
        store(row.data() + i, v);
        ss = fma(v, v, ss);
      }
      const VecF scale = splat(1.f / std::sqrt(hsum(ss) / hidden + static_cast<float>(eps)));
      for (int64_t i = 0; i < hidden; i += kLanes)
        store_row_chunk(op + r * hidden + i, _mm256_mul_ps(_mm256_mul_ps(load_f32(row.data() + i), scale), load_chunk(wp + i)));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * d;
      const T* up = gate + d;
      for (int64_t i = 0; i < d; i += kLanes) {
        const VecF g = load_chunk(gate + i);
        const VecF silu = _mm256_div_ps(g, _mm256_add_ps(splat(1.f), exp_clamped(_mm256_sub_ps(zero(), g))));
        store_row_chunk(op + r * d + i, _mm256_mul_ps(silu, load_chunk(up + i)));
      }
    }
  });
}

}  // namespace

// out = rms_norm(x) * weight, or with `residual` given: residual += x, out = rms_norm(residual) * weight.
// x, residual, out [rows, hidden] contiguous, hidden % 8 == 0; float32 or bfloat16, all one dtype.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kLanes == 0, "rms_norm: bad input");
  torch::Tensor res = residual.has_value() ? residual.value() : torch::Tensor();
  if (res.defined()) TORCH_CHECK(res.is_contiguous() && res.sizes() == x.sizes(), "rms_norm: bad residual");
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16) rms_norm_impl<c10::BFloat16>(x, res, weight, out, eps);
  else if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(x, res, weight, out, eps);
  else TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  return out;
}

// x [rows, 2 d] = gate | up → silu(gate) * up [rows, d]; d % 8 == 0.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % (2 * kLanes) == 0, "silu_and_mul: bad input");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kBFloat16) silu_and_mul_impl<c10::BFloat16>(x, out);
  else if (x.scalar_type() == torch::kFloat32) silu_and_mul_impl<float>(x, out);
  else TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  return out;
}

// ---- rotary embedding fused with the KV-cache write ----

namespace {

inline VecF round_to(VecF v, float*) { return v; }
inline VecF round_to(VecF v, c10::BFloat16*) {  // float → bf16 → float
  return _mm256_castsi256_ps(_mm256_and_si256(round_to_bf16_bits(v), _mm256_set1_epi32(0xFFFF0000)));
}
// A rounded product: the empty asm makes the compiler materialise it, so that it is never contracted
// with the following add into an FMA, and the result rounds exactly as torch's separate
// `x * cos + rotate_half(x) * sin` does.
inline VecF mul_exact(VecF a, VecF b) {
  VecF p = _mm256_mul_ps(a, b);
  asm("" : "+x"(p));
  return p;
}
inline VecF add_exact(VecF a, VecF b) { return _mm256_add_ps(a, b); }

inline VecF negate(VecF v) {  // exactly torch's neg, signed zeros included
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x80000000)));
}

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
void rotate_tokens(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_heads,
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
void rotary_write_kv_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
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
// [num_slots, kv_heads, head_dim] caches. head_dim % 16 == 0; float32 or bfloat16, one dtype.
void rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                     torch::Tensor v_cache, c10::optional<torch::Tensor> slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(2) % (2 * kLanes) == 0, "rotary_write_kv: bad qkv");
  TORCH_CHECK((qkv.size(1) - num_heads) % 2 == 0 && qkv.size(1) > num_heads, "rotary_write_kv: bad head count");
  cos = cos.reshape({qkv.size(0), qkv.size(2)}).contiguous();
  sin = sin.reshape({qkv.size(0), qkv.size(2)}).contiguous();
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rotary_write_kv: dtypes differ");
  torch::Tensor slots;
  if (slot_mapping.has_value()) {
    slots = slot_mapping.value().to(torch::kInt64).contiguous();
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
  if (qkv.scalar_type() == torch::kBFloat16)
    rotary_write_kv_impl<c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  else if (qkv.scalar_type() == torch::kFloat32)
    rotary_write_kv_impl<float>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  else TORCH_CHECK(false, "rotary_write_kv: float32 or bfloat16 only");
}

// ---- int8 KV cache (--kv-cache-dtype int8) ----
//
// The layout and the quantization of cpu_kernels.cpp (int8_kv.h; the PyTorch reference is
// kestrel/model/attention.py's write_kv and gather_kv). A block's 16 keys are two 8-lane vectors here.

namespace {

constexpr int64_t kInt8Block = kestrel_int8_kv::kBlock;

inline float hmax(VecF v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Lanes i < n of an 8-lane vector, as an all-ones mask.
inline VecF lanes_below(int64_t n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t m = static_cast<int32_t>(std::max<int64_t>(-1, std::min<int64_t>(n, kLanes)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(m), iota));
}

// 8 int8 values as float32.
inline VecF load_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Quantize one row of d floats (d % 8 == 0); returns the scale. Bit for bit the AVX-512 build's.
inline float quantize_row(const float* x, int64_t d, int8_t* q, int64_t q_stride) {
  VecF amax = zero();
  for (int64_t i = 0; i < d; i += kLanes)
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(splat(-0.f), load_f32(x + i)));
  const float m = hmax(amax);
  if (m == 0.f) {
    for (int64_t i = 0; i < d; ++i) q[i * q_stride] = 0;
    return 0.f;
  }
  const float scale = m / 127.f;
  const VecF sv = splat(scale);
  alignas(32) int32_t qi[kLanes];
  for (int64_t i = 0; i < d; i += kLanes) {
    // true division, then round half to even (the default rounding mode), as torch.round(x / scale)
    _mm256_store_si256(reinterpret_cast<__m256i*>(qi), _mm256_cvtps_epi32(_mm256_div_ps(load_f32(x + i), sv)));
    for (int j = 0; j < kLanes; ++j) q[(i + j) * q_stride] = static_cast<int8_t>(qi[j]);
  }
  return scale;
}

template <typename T>
void rotary_write_kv_int8_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor& k_t, torch::Tensor& k_scale, torch::Tensor& v, torch::Tensor& v_scale,
                               const torch::Tensor& slots, int64_t num_heads) {
  const int64_t d = qkv.size(2), kv_heads = (qkv.size(1) - num_heads) / 2;
  int8_t* ktp = k_t.data_ptr<int8_t>();
  float* ksp = k_scale.data_ptr<float>();
  int8_t* vp = v.data_ptr<int8_t>();
  float* vsp = v_scale.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  rotate_tokens<T>(qkv, cos, sin, num_heads, 16, [&](int64_t t, const T* row) {
    float row_f[256];  // head_dim <= 256
    const int64_t blk = slot[t] / kInt8Block, off = slot[t] % kInt8Block;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t i = 0; i < d; i += kLanes) store(row_f + i, load_chunk(row + (num_heads + h) * d + i));
      ksp[(blk * kv_heads + h) * kInt8Block + off] =
          quantize_row(row_f, d, ktp + (blk * kv_heads + h) * d * kInt8Block + off, kInt8Block);
      for (int64_t i = 0; i < d; i += kLanes) store(row_f + i, load_chunk(row + (num_heads + kv_heads + h) * d + i));
      vsp[slot[t] * kv_heads + h] = quantize_row(row_f, d, vp + (slot[t] * kv_heads + h) * d, 1);
    }
  });
}

// Decode attention over the int8 cache, the plan of cpu_kernels.cpp's run_int8 in 16 registers of 8
// lanes: one (sequence, KV head) per work item, items to threads by cost; the scores of a block's 16
// keys (two vectors) from the transposed K, kInt8HeadChunk<G> query heads at a time; a softmax over
// each head's scores, each exponential stored times its V row's scale; then the V rows weighted,
// kInt8VChunk<G> vectors of dimensions at a time (the item's V rows, read again for each, are in L2
// by then). While a block is computed, the block kInt8PrefetchUnits ahead in the item's order of
// reading (K blocks, then V blocks, then the next item's) is prefetched a line at a time.
template <int G>
constexpr int kInt8HeadChunk = G % 3 == 0 ? 3 : (G % 4 == 0 ? 4 : (G % 2 == 0 ? 2 : 1));
template <int G>
constexpr int kInt8VChunk = G <= 2 ? 4 : (G <= 5 ? 2 : 1);
constexpr int64_t kInt8PrefetchUnits = 5;

template <int D, int G>
void run_int8(const torch::Tensor& q, const torch::Tensor& k_t, const torch::Tensor& k_scale,
              const torch::Tensor& v, const torch::Tensor& v_scale, const torch::Tensor& block_tables,
              const torch::Tensor& seq_lens, torch::Tensor& out, float scale) {
  constexpr int JC = kInt8HeadChunk<G>;
  constexpr int P = 2 * JC >= 8 ? 1 : 2;  // partial sums per (head, half block): 8 or more FMA chains
  constexpr int VC = kInt8VChunk<G>;
  static_assert((D / kLanes) % VC == 0 && G % JC == 0, "whole chunks of heads and of dimensions");
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
    alignas(32) float qs[D][G];  // scaled q by dimension
    for (int j = 0; j < G; ++j)
      for (int dd = 0; dd < D; ++dd) qs[dd][j] = qf[(s * num_heads + h * G + j) * D + dd] * scale;
    scores.resize(G * span);
    vscales.resize(span);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = table[b];
      const int8_t* kb = ktp + (blk * kv_heads + h) * D * BS;
      const Rows ahead = order.unit(item, b + kInt8PrefetchUnits);
      const int64_t n = std::min<int64_t>(BS, len - b * BS);
      const VecF valid[2] = {lanes_below(n), lanes_below(n - kLanes)};
      const VecF sk[2] = {load_f32(ksp + (blk * kv_heads + h) * BS), load_f32(ksp + (blk * kv_heads + h) * BS + kLanes)};
      for (int j0 = 0; j0 < G; j0 += JC) {
        VecF acc[JC][2][P];
        for (int j = 0; j < JC; ++j)
          for (int half = 0; half < 2; ++half)
            for (int p = 0; p < P; ++p) acc[j][half][p] = zero();
        for (int dd = 0; dd < D; dd += 4) {
          if (j0 == 0) ahead.prefetch(dd / 4);  // D / 4 lines: the unit's 16 * D / 64
          for (int i = 0; i < 4; ++i) {
            const VecF k0 = load_int8(kb + (dd + i) * BS), k1 = load_int8(kb + (dd + i) * BS + kLanes);
            for (int j = 0; j < JC; ++j) {
              const VecF qv = splat(qs[dd + i][j0 + j]);
              acc[j][0][i % P] = fma(qv, k0, acc[j][0][i % P]);
              acc[j][1][i % P] = fma(qv, k1, acc[j][1][i % P]);
            }
          }
        }
        for (int j = 0; j < JC; ++j)
          for (int half = 0; half < 2; ++half) {
            VecF sum = acc[j][half][0];
            for (int p = 1; p < P; ++p) sum = _mm256_add_ps(sum, acc[j][half][p]);
            store(scores.data() + (j0 + j) * span + b * BS + half * kLanes,
                  _mm256_blendv_ps(splat(neg_inf), _mm256_mul_ps(sum, sk[half]), valid[half]));
          }
      }
      // The block's V row scales, in the order of the scores.
      const __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                               _mm256_set1_epi32(static_cast<int>(kv_heads)));
      const float* vs = vsp + blk * BS * kv_heads + h;
      store(vscales.data() + b * BS, _mm256_i32gather_ps(vs, index, 4));
      store(vscales.data() + b * BS + kLanes, _mm256_i32gather_ps(vs + kLanes * kv_heads, index, 4));
    }
    // Each score becomes its exponential times its V row's scale; the sum is of the exponentials.
    float inv[G];
    for (int j = 0; j < G; ++j) {
      float* sj = scores.data() + j * span;
      VecF mv = splat(neg_inf);
      for (int64_t t = 0; t < span; t += kLanes) mv = _mm256_max_ps(mv, load_f32(sj + t));
      const VecF m = splat(hmax(mv));
      VecF sum = zero();
      for (int64_t t = 0; t < span; t += kLanes) {
        const VecF e = _mm256_and_ps(lanes_below(len - t), exp_clamped(_mm256_sub_ps(load_f32(sj + t), m)));
        store(sj + t, _mm256_mul_ps(e, load_f32(vscales.data() + t)));
        sum = _mm256_add_ps(sum, e);
      }
      inv[j] = 1.f / hsum(sum);
    }
    for (int c0 = 0; c0 < D / kLanes; c0 += VC) {
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
        for (int c = 0; c < VC; ++c) store(dst + j * D + (c0 + c) * kLanes, _mm256_mul_ps(acc[j][c], splat(inv[j])));
    }
  };

  parallel_for_by_cost(items, [&](int64_t item) { return 1 + order.blocks_of(item); }, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, vscales;
    for (int64_t item = begin; item < end; ++item) one_item(item, scores, vscales);
  });
}

}  // namespace

// rotary_write_kv for the int8 cache: rotates q and k in place and writes k, v quantized.
void rotary_write_kv_int8(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_t,
                          torch::Tensor k_scale, torch::Tensor v, torch::Tensor v_scale, torch::Tensor slot_mapping,
                          int64_t num_heads) {
  const auto slots = kestrel_int8_kv::checked_write_args(qkv, cos, sin, k_t, k_scale, v, v_scale, slot_mapping,
                                                        num_heads, kLanes);
  if (qkv.scalar_type() == torch::kBFloat16)
    rotary_write_kv_int8_impl<c10::BFloat16>(qkv, cos, sin, k_t, k_scale, v, v_scale, slots, num_heads);
  else if (qkv.scalar_type() == torch::kFloat32)
    rotary_write_kv_int8_impl<float>(qkv, cos, sin, k_t, k_scale, v, v_scale, slots, num_heads);
  else TORCH_CHECK(false, "rotary_write_kv_int8: float32 or bfloat16 only");
}

// Decode attention over the int8 cache (layout above; block_size 16). Returns float32, or with
// `in_q_dtype` q's dtype.
torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_t, torch::Tensor k_scale, torch::Tensor v,
                                          torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor seq_lens,
                                          int64_t block_size, double scale, bool in_q_dtype) {
  kestrel_int8_kv::check_decode_args(q, k_t, k_scale, v, v_scale, block_size);
  const auto out_dtype = q.scalar_type();
  auto qf = q.to(torch::kFloat32).contiguous();
  auto out = torch::empty(qf.sizes(), qf.options());
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t d = q.size(2), g = q.size(1) / v.size(1);
  const float sc = static_cast<float>(scale);
  bool done = false;
#define KESTREL_CASE(D, G) \
  if (!done && d == D && g == G) { run_int8<D, G>(qf, k_t, k_scale, v, v_scale, block_tables, seq_lens, out, sc); done = true; }
  KESTREL_CASE(64, 1) KESTREL_CASE(64, 2) KESTREL_CASE(64, 3) KESTREL_CASE(64, 4)
  KESTREL_CASE(64, 5) KESTREL_CASE(64, 8)
  KESTREL_CASE(128, 1) KESTREL_CASE(128, 2) KESTREL_CASE(128, 4) KESTREL_CASE(128, 8)
#undef KESTREL_CASE
  TORCH_CHECK(done, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return in_q_dtype ? in_dtype(out, out_dtype) : out;
}

// ---- argmax over the rows of float32 logits ----

namespace {

// The first index of the row's maximum, NaN counting as above everything (torch.argmax's rule).
int64_t argmax_row(const float* x, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  const __m256i step = _mm256_set1_epi32(kLanes);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), best_i = idx;
  VecF best = splat(-std::numeric_limits<float>::infinity()), nan = zero();
  for (int64_t i = 0; i < full; i += kLanes) {
    const VecF v = load_f32(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const VecF gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly: each lane keeps its first
    best = _mm256_blendv_ps(best, v, gt);
    best_i = _mm256_blendv_epi8(best_i, idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, step);
  }
  if (_mm256_movemask_ps(nan))
    for (int64_t i = 0; i < full; ++i)
      if (std::isnan(x[i])) return i;
  alignas(32) float bv[kLanes];
  alignas(32) int32_t bi[kLanes];
  store(bv, best);
  _mm256_store_si256((__m256i*)bi, best_i);
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
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.size(1) > 0 &&
              x.size(1) < (int64_t(1) << 31), "argmax_rows: float32 [rows, n] contiguous");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// ---- float32 linear layers for decode-sized batches ----
//
// linear_f32(x [M, K], w [N, K]) -> y [M, N] = x w^T, float32, K % 8 == 0. The library GEMM reaches
// 15-110 GFLOP/s on this kind of machine at 1-64 rows (and under 50 on the output head at 1-32),
// against ~130-170 at prefill sizes. Here a tile of 4 rows of x by 3 rows of w keeps 12
// accumulators of 8 lanes in registers (with the 3 w vectors and one x vector, all 16 AVX2
// registers), each summed across its lanes at the end. Threads take tiles of 3 weight rows; each
// keeps its 3 rows in L1 while it walks every 4-row block of x, and K is cut into pieces of at most
// kMaxKPiece so that the block of x being walked stays in L2 (512 KB) at 64-128 rows.

namespace {

constexpr int64_t kMaxKPiece = 768;
constexpr int64_t kMaxStreamRows = 4;  // up to here, gemv_rows; beyond, the register tiles

// Keeps a loaded vector in a register. Without it, GCC tuning for Zen 3 (-march=native there) folds
// the loads into the FMAs as memory operands: 16 loads per 12 FMAs instead of 7, which leaves the
// tile bound by the load ports at ~60% of the register-operand speed (measured).
inline VecF in_register(VecF v) {
  asm("" : "+x"(v));
  return v;
}

// y[m, n] (+)= x[m, k0:k1] . w[n, k0:k1] for MR rows of x from `x` and NR rows of w from `w`; with
// `next` given, the same part of the next NR rows of w is prefetched along the way (the weights
// stream from memory, and the hardware prefetcher alone leaves much of its latency exposed).
template <int MR, int NR>
inline void linear_tile(const float* x, const float* w, int64_t K, int64_t k0, int64_t k1, float* y, int64_t N,
                        bool accumulate, const float* next) {
  VecF acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = zero();
  for (int64_t k = k0; k < k1; k += kLanes) {
    if (next != nullptr && k % 16 == 0)
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(next + n * K + k), _MM_HINT_T0);
    VecF wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = in_register(load_f32(w + n * K + k));
    for (int m = 0; m < MR; ++m) {
      const VecF xv = in_register(load_f32(x + m * K + k));
      for (int n = 0; n < NR; ++n) acc[m][n] = fma(xv, wv[n], acc[m][n]);
    }
  }
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
  for (; m + 4 <= M; m += 4, next = nullptr) linear_tile<4, NR>(x + m * K, wn, K, k0, k1, y + m * N + n0, N, acc, next);
  switch (M - m) {
    case 3: linear_tile<3, NR>(x + m * K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    case 2: linear_tile<2, NR>(x + m * K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    case 1: linear_tile<1, NR>(x + m * K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    default: break;
  }
}

// y[m, n] = x[m] . w[n] for MR (1-4) rows of x, n in [n0, n1): each weight row is read start to
// end, so that a thread's weights are one sequential stream, the hardware prefetcher's best case
// (interleaving 3 rows as the tiles do measured 10-15% slower at one row). Two accumulators per
// row of x hide the FMA latency.
template <int MR>
void gemv_rows(const float* x, const float* w, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    VecF a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = zero();
    int64_t k = 0;
    for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
      const VecF w0 = in_register(load_f32(wr + k)), w1 = in_register(load_f32(wr + k + kLanes));
      for (int m = 0; m < MR; ++m) {
        a[m][0] = fma(load_f32(x + m * K + k), w0, a[m][0]);
        a[m][1] = fma(load_f32(x + m * K + k + kLanes), w1, a[m][1]);
      }
    }
    if (k < K) {
      const VecF w0 = load_f32(wr + k);
      for (int m = 0; m < MR; ++m) a[m][0] = fma(load_f32(x + m * K + k), w0, a[m][0]);
    }
    for (int m = 0; m < MR; ++m) y[m * N + n] = hsum(_mm256_add_ps(a[m][0], a[m][1]));
  }
}

}  // namespace

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_f32: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "linear_f32: float32 only");
  TORCH_CHECK(x.size(1) % kLanes == 0, "linear_f32: K must be a multiple of 8");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kMaxStreamRows) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      switch (M) {
        case 1: gemv_rows<1>(xp, wp, K, begin, end, yp, N); break;
        case 2: gemv_rows<2>(xp, wp, K, begin, end, yp, N); break;
        case 3: gemv_rows<3>(xp, wp, K, begin, end, yp, N); break;
        default: gemv_rows<4>(xp, wp, K, begin, end, yp, N); break;
      }
    });
    return y;
  }
  const int64_t pieces = (K + kMaxKPiece - 1) / kMaxKPiece;
  const int64_t piece = ((K + pieces - 1) / pieces + kLanes - 1) / kLanes * kLanes;
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

// ---- the float32 decode plan's layer loop ----

// The layer loop of kestrel/model/decode_plan.py for a float32 Llama-family model without q/k norms
// or biases, in C++: the same kernels in the same order on the same tensors, so its hidden states
// are bit-identical to the Python loop's (and so to the model's forward). What it saves is the
// Python between the ~300 kernel calls of a step: ~1.5-2 ms of a ~27 ms batch-1 step here.
class DecodeLayersF32 {
 public:
  // weights: 6 per layer (input norm, qkv, o, post-attention norm, gate_up, down); caches: k, v per
  // layer, each [num_slots, kv_heads, head_dim].
  DecodeLayersF32(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> caches, int64_t heads,
                  double eps, double scale)
      : weights_(std::move(weights)), caches_(std::move(caches)), heads_(heads), eps_(eps), scale_(scale) {
    TORCH_CHECK(weights_.size() % 6 == 0 && caches_.size() * 3 == weights_.size(),
                "DecodeLayersF32: 6 weights and 2 caches per layer");
    for (const auto& w : weights_)
      TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "DecodeLayersF32: float32 contiguous weights");
  }

  // x [n, hidden]: the embedded tokens. Returns the hidden states before the final norm.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                        torch::Tensor table, torch::Tensor seq_lens, int64_t block_size) const {
    const int64_t n = x.size(0), layers = static_cast<int64_t>(caches_.size() / 2);
    torch::Tensor residual, h;
    for (int64_t l = 0; l < layers; ++l) {
      const torch::Tensor* w = weights_.data() + 6 * l;
      const torch::Tensor &k_cache = caches_[2 * l], &v_cache = caches_[2 * l + 1];
      if (!residual.defined()) {
        residual = x;
        h = rms_norm(x, c10::nullopt, w[0], eps_);
      } else {
        h = rms_norm(x, residual, w[0], eps_);  // residual += x, in place
      }
      const int64_t head_dim = k_cache.size(2), kv_heads = k_cache.size(1);
      torch::Tensor qkv = linear_f32(h, w[1]).view({n, heads_ + 2 * kv_heads, head_dim});
      rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads_);
      torch::Tensor out = paged_decode_attention(qkv.slice(1, 0, heads_), k_cache, v_cache, table, seq_lens,
                                                 block_size, scale_, true);
      h = rms_norm(linear_f32(out.view({n, heads_ * head_dim}), w[2]), residual, w[3], eps_);
      x = linear_f32(silu_and_mul(linear_f32(h, w[4])), w[5]);
    }
    return x + residual;
  }

 private:
  std::vector<torch::Tensor> weights_, caches_;
  int64_t heads_;
  double eps_, scale_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
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
  m.def("supports", &supports, "whether a (head_dim, group) pair has a kernel");
  m.def("linear_f32", &linear_f32, "x w^T in float32 for decode-sized batches (CPU)");
  py::class_<DecodeLayersF32>(m, "DecodeLayersF32")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t, double, double>(),
           py::arg("weights"), py::arg("caches"), py::arg("heads"), py::arg("eps"), py::arg("scale"))
      .def("__call__", &DecodeLayersF32::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("table"), py::arg("seq_lens"), py::arg("block_size"));
}
