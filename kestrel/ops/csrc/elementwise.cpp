// The row-wise kernels of a layer: RMSNorm (optionally fused with the residual add), SiLU-and-mul,
// rotary embedding fused with the KV-cache write, and argmax over the rows of logits. One pass over
// each row. Their PyTorch references: kestrel/ops/dispatch.py.
#include "kernel.h"
#include "kernels.h"
#include "rotary.h"

namespace {

template <typename T, typename W>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.defined() ? residual.data_ptr<T>() : nullptr;
  const W* wp = weight.data_ptr<W>();
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

// GELU with the tanh approximation: 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3).
inline VecF gelu_tanh(VecF g) {
  const VecF u = mul(splat(0.7978845608028654f), fma(mul(splat(0.044715f), mul(g, g)), g, g));
  return div(g, add(splat(1.f), exp_clamped(mul(splat(-2.f), u))));
}

// act(gate) * up, act SiLU or (GELU) GELU-tanh, computed in float32 and rounded once.
template <typename T, bool GELU>
void gate_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * d;
      const T* up = gate + d;
      for (int64_t i = 0; i < d; i += kLanes) {
        const VecF g = load_chunk(gate + i);
        const VecF act = GELU ? gelu_tanh(g) : div(g, add(splat(1.f), exp_clamped(sub(zero(), g))));
        store_row_chunk(op + r * d + i, mul(act, load_chunk(up + i)));
      }
    }
  });
}
}  // namespace


// out = rms_norm(x) * weight, or with `residual` given: residual += x, out = rms_norm(residual) * weight.
// x, residual, out [rows, hidden] contiguous, hidden % kLanes == 0; float32 or bfloat16, all one dtype, but
// for the weight, which may be float32 with a bfloat16 x (Gemma's 1 + w: the product is rounded once).
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kLanes == 0, "rms_norm: bad input");
  at::Tensor res = residual.has_value() ? residual.value() : at::Tensor();
  if (res.defined()) TORCH_CHECK(res.is_contiguous() && res.sizes() == x.sizes(), "rms_norm: bad residual");
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "rms_norm: the weight must be x's dtype or float32");
  with_float_dtype(x.scalar_type(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    if (weight.scalar_type() == at::kFloat) rms_norm_impl<T, float>(x, res, weight, out, eps);
    else rms_norm_impl<T, T>(x, res, weight, out, eps);
  });
  return out;
}

// x [rows, 2 d] = gate | up → silu(gate) * up [rows, d]; d % kLanes == 0.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % (2 * kLanes) == 0, "silu_and_mul: bad input");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  with_float_dtype(x.scalar_type(), "silu_and_mul", [&](auto t) { gate_and_mul_impl<decltype(t), false>(x, out); });
  return out;
}

// x [rows, 2 d] = gate | up → gelu_tanh(gate) * up [rows, d] (Gemma's MLP); d % kLanes == 0.
at::Tensor gelu_tanh_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % (2 * kLanes) == 0, "gelu_tanh_and_mul: bad input");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  with_float_dtype(x.scalar_type(), "gelu_tanh_and_mul", [&](auto t) { gate_and_mul_impl<decltype(t), true>(x, out); });
  return out;
}

// ---- rotary embedding fused with the KV-cache write ----

namespace {

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
