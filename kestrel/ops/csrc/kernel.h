// What every kernel source written on the vector interface includes: PyTorch's C++ API, the
// vector interface of this build's instruction set (isa.h), the work sharing, and the helpers that
// move rows of the model dtype (float32 or bf16) in and out of float32 vectors. Each source is one
// translation unit of its ISA's extension; everything here is internal to it (an unnamed namespace).
#pragma once

#include "torch_api.h"
#include <c10/util/BFloat16.h>

#include "isa.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
// The first key a decode query at context length `len` sees: 0, or with a sliding window W > 0, len - W.
inline int64_t first_visible_key(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

template <typename F>
bool with_head_shape(int64_t d, int64_t g, const F& f) {
#define KESTREL_CASE(D, G)                                                            \
  if (d == D && g == G) {                                                             \
    f(std::integral_constant<int, D>{}, std::integral_constant<int, G>{});            \
    return true;                                                                      \
  }
  // The query heads per KV head of the models Kestrel runs: Qwen2.5 0.5B (64, 7), 1.5B (128, 6), 7B
  // (128, 7); Phi-4-mini (128, 3); Gemma 3 (256, 4), Gemma 2 (256, 2); Llama, Mistral, Granite the rest.
  KESTREL_CASE(64, 1) KESTREL_CASE(64, 2) KESTREL_CASE(64, 3) KESTREL_CASE(64, 4)
  KESTREL_CASE(64, 5) KESTREL_CASE(64, 6) KESTREL_CASE(64, 7) KESTREL_CASE(64, 8)
  KESTREL_CASE(128, 1) KESTREL_CASE(128, 2) KESTREL_CASE(128, 3) KESTREL_CASE(128, 4) KESTREL_CASE(128, 6)
  KESTREL_CASE(128, 7) KESTREL_CASE(128, 8)
  KESTREL_CASE(256, 1) KESTREL_CASE(256, 2) KESTREL_CASE(256, 4)
#undef KESTREL_CASE
  return false;
}

// A decode kernel's float32 result, rounded once to `dtype` (bf16, round to nearest even, as .to()
// rounds) or returned as is. Here, not through .to(): on so small a tensor .to() is mostly dispatch,
// and it would run once per layer of every decode step.
inline at::Tensor in_dtype(const at::Tensor& out, c10::ScalarType dtype) {
  if (dtype == at::kFloat) return out;
  TORCH_CHECK(dtype == at::kBFloat16, "q must be float32 or bfloat16");
  auto rounded = at::empty(out.sizes(), out.options().dtype(at::kBFloat16));
  const float* src = out.data_ptr<float>();
  c10::BFloat16* dst = rounded.data_ptr<c10::BFloat16>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) dst[i] = c10::BFloat16(src[i]);
  return rounded;
}


// f<T>() for the dtype of a float32 or bfloat16 tensor; `what` names the kernel in the error.
template <typename F>
void with_float_dtype(c10::ScalarType dtype, const char* what, const F& f) {
  if (dtype == at::kBFloat16) f(c10::BFloat16{});
  else if (dtype == at::kFloat) f(float{});
  else TORCH_CHECK(false, what, ": float32 or bfloat16 only");
}

}  // namespace
