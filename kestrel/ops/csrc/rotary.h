// Rotary embedding of a token's q and k heads in place (Hugging Face's rotate_half layout), shared by
// the KV-cache writes of both cache dtypes (elementwise.cpp, int8_kv.cpp).
#pragma once

#include "kernel.h"

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

}  // namespace
