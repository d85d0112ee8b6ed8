// Kestrel's CPU kernels (AVX-512; float32 or bf16 storage, float32 math). Their PyTorch references
// live in kestrel/model/attention.py and kestrel/model/layers.py; tests/test_cpu_kernels.py compares.
//
// paged_decode_attention: one query token per sequence, grouped-query heads, read straight from the
// paged KV cache with no gathered copy. One work item per (sequence, KV head): it reads each K row
// once (scores for the GROUP query heads that share it), then each V row once (weighted sums kept
// in registers).
// rms_norm (optionally fused with the residual add) and silu_and_mul: one pass over each row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using VecF = __m512;
inline VecF load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline VecF load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF zero() { return _mm512_setzero_ps(); }
inline VecF splat(float x) { return _mm512_set1_ps(x); }
inline float hsum(VecF v) { return _mm512_reduce_add_ps(v); }
inline void store(float* p, VecF v) { _mm512_storeu_ps(p, v); }

// exp(x), x clamped to [-87, 88]: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6
// polynomial (relative error ~2e-7, float's own rounding).
inline VecF exp_clamped(VecF x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const VecF t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const VecF n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VecF f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));  // f ln 2
  VecF p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#else
#error "this kernel needs AVX-512; kestrel falls back to the PyTorch path elsewhere"
#endif

template <bool BF16>
inline VecF load_row_chunk(const void* base, int64_t offset) {
  if constexpr (BF16) return load_bf16(static_cast<const uint16_t*>(base) + offset);
  else return load_f32(static_cast<const float*>(base) + offset);
}

template <bool BF16, int D, int G>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
         int64_t block_size, float scale) {
  constexpr int C = D / kLanes;  // vector chunks per row
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), slot_stride = kv_heads * D;
  const int64_t elem = BF16 ? 2 : 4;
  const char* kp = static_cast<const char*>(k_cache.data_ptr());
  const char* vp = static_cast<const char*>(v_cache.data_ptr());
  const float* qf_all = q.data_ptr<float>();   // q arrives as float32
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      VecF qv[G][C];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c)
          qv[j][c] = _mm512_mul_ps(load_f32(qf_all + (s * num_heads + h * G + j) * D + c * kLanes), splat(scale));
      scores.resize(G * len);
      float mx[G];
      for (int j = 0; j < G; ++j) mx[j] = -std::numeric_limits<float>::infinity();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const char* kb = kp + ((table[t0 / block_size] * block_size) * slot_stride + h * D) * elem;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t o = 0; o < n; ++o) {
          const void* row = kb + o * slot_stride * elem;
          VecF kr[C];
          for (int c = 0; c < C; ++c) kr[c] = load_row_chunk<BF16>(row, c * kLanes);
          for (int j = 0; j < G; ++j) {
            VecF acc = _mm512_mul_ps(qv[j][0], kr[0]);
            for (int c = 1; c < C; ++c) acc = fma(qv[j][c], kr[c], acc);
            const float sc = hsum(acc);
            scores[j * len + t0 + o] = sc;
            mx[j] = std::max(mx[j], sc);
          }
        }
      }
      float inv[G];
      for (int j = 0; j < G; ++j) {
        float* sj = scores.data() + j * len;
        const VecF m = splat(mx[j]);
        VecF sum = zero();
        for (int64_t t = 0; t < len; t += kLanes) {
          const __mmask16 lanes = len - t >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1);
          const VecF e = exp_clamped(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sj + t), m));
          _mm512_mask_storeu_ps(sj + t, lanes, e);
          sum = _mm512_mask_add_ps(sum, lanes, sum, e);
        }
        inv[j] = 1.f / hsum(sum);
      }
      VecF acc[G][C];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c) acc[j][c] = zero();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const char* vb = vp + ((table[t0 / block_size] * block_size) * slot_stride + h * D) * elem;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t o = 0; o < n; ++o) {
          const void* row = vb + o * slot_stride * elem;
          VecF vr[C];
          for (int c = 0; c < C; ++c) vr[c] = load_row_chunk<BF16>(row, c * kLanes);
          for (int j = 0; j < G; ++j) {
            const VecF p = splat(scores[j * len + t0 + o]);
            for (int c = 0; c < C; ++c) acc[j][c] = fma(p, vr[c], acc[j][c]);
          }
        }
      }
      for (int j = 0; j < G; ++j) {
        float* dst = op + (s * num_heads + h * G + j) * D;
        for (int c = 0; c < C; ++c) store(dst + c * kLanes, _mm512_mul_ps(acc[j][c], splat(inv[j])));
      }
    }
  });
}

}  // namespace

// q [num_seqs, num_heads, head_dim] float32; k_cache, v_cache [num_slots, kv_heads, head_dim] float32 or
// bfloat16; block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs] int64 (keys 0..len-1 visible).
// Returns float32 [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == torch::kFloat32, "the KV cache must be float32 or bfloat16");
  q = q.to(torch::kFloat32).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const int64_t d = q.size(2), g = q.size(1) / k_cache.size(1);
  const float sc = static_cast<float>(scale);
#define KESTREL_CASE(D, G)                                                                   \
  if (d == D && g == G) {                                                                    \
    if (bf16) run<true, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc);  \
    else run<false, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc);      \
    return out;                                                                              \
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

inline void store_row_chunk(float* p, VecF v) { _mm512_storeu_ps(p, v); }
// float → bf16 with round-to-nearest-even, as torch's .to(torch.bfloat16) does.
inline void store_row_chunk(c10::BFloat16* p, VecF v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}
inline VecF load_chunk(const float* p) { return _mm512_loadu_ps(p); }
inline VecF load_chunk(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }

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
          store_row_chunk(rp + r * hidden + i, _mm512_add_ps(v, load_chunk(rp + r * hidden + i)));
          v = load_chunk(rp + r * hidden + i);
        }
        _mm512_storeu_ps(row.data() + i, v);
        ss = fma(v, v, ss);
      }
      const VecF scale = splat(1.f / std::sqrt(hsum(ss) / hidden + static_cast<float>(eps)));
      for (int64_t i = 0; i < hidden; i += kLanes)
        store_row_chunk(op + r * hidden + i,
                        _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), scale), load_chunk(wp + i)));
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
        const VecF silu = _mm512_div_ps(g, _mm512_add_ps(splat(1.f), exp_clamped(_mm512_sub_ps(zero(), g))));
        store_row_chunk(op + r * d + i, _mm512_mul_ps(silu, load_chunk(up + i)));
      }
    }
  });
}

}  // namespace

// out = rms_norm(x) * weight, or with `residual` given: residual += x, out = rms_norm(residual) * weight.
// x, residual, out [rows, hidden] contiguous, hidden % 16 == 0; float32 or bfloat16, all one dtype.
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

// x [rows, 2 d] = gate | up → silu(gate) * up [rows, d]; d % 16 == 0.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % (2 * kLanes) == 0, "silu_and_mul: bad input");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kBFloat16) silu_and_mul_impl<c10::BFloat16>(x, out);
  else if (x.scalar_type() == torch::kFloat32) silu_and_mul_impl<float>(x, out);
  else TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add (CPU)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (CPU)");
  m.def("supports", &supports, "whether a (head_dim, group) pair has a kernel");
}
