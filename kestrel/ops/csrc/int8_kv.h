// The int8 KV cache (--kv-cache-dtype int8) as both builds of int8_kv.cpp see it, free of any
// vector width: argument checks, and the order in which a decode work item reads
// the cache. Layout: each (token, KV head) row of head_dim values as int8 with one float32 scale
// (max|x| / 127); K transposed within blocks of 16 tokens, k_t [num_blocks, kv_heads, head_dim, 16],
// k_scale [num_blocks, kv_heads, 16]; V by rows, v [num_slots, kv_heads, head_dim], v_scale
// [num_slots, kv_heads]. The PyTorch reference is kestrel/attention/kv_cache.py (write_kv, gather_kv).
// Part of each kernel's build key (kestrel/ops/build.py follows the includes).
#pragma once

#include "torch_api.h"

#include <immintrin.h>

#include <cstdint>

namespace kestrel_int8_kv {

constexpr int64_t kBlock = 16;

// rotary_write_kv_int8's arguments checked (head_dim a multiple of 2 * lanes, at most 256); cos and
// sin reshaped to [tokens, head_dim]; returns the slots as contiguous int64.
inline at::Tensor checked_write_args(const at::Tensor& qkv, at::Tensor& cos, at::Tensor& sin,
                                     const at::Tensor& k_t, const at::Tensor& k_scale,
                                     const at::Tensor& v, const at::Tensor& v_scale,
                                     const at::Tensor& slot_mapping, int64_t num_heads, int64_t lanes) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(2) % (2 * lanes) == 0, "rotary_write_kv_int8: bad qkv");
  TORCH_CHECK((qkv.size(1) - num_heads) % 2 == 0 && qkv.size(1) > num_heads, "rotary_write_kv_int8: bad head count");
  const int64_t kv_heads = (qkv.size(1) - num_heads) / 2, d = qkv.size(2);
  TORCH_CHECK(d <= 256, "rotary_write_kv_int8: head_dim above 256");
  cos = cos.reshape({qkv.size(0), d}).contiguous();
  sin = sin.reshape({qkv.size(0), d}).contiguous();
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rotary_write_kv_int8: dtypes differ");
  TORCH_CHECK(k_t.scalar_type() == at::kChar && v.scalar_type() == at::kChar &&
              k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
              k_t.is_contiguous() && v.is_contiguous() && k_scale.is_contiguous() && v_scale.is_contiguous() &&
              k_t.dim() == 4 && k_t.size(1) == kv_heads && k_t.size(2) == d && k_t.size(3) == kBlock &&
              v.dim() == 3 && v.size(0) == k_t.size(0) * kBlock && v.size(1) == kv_heads && v.size(2) == d &&
              k_scale.numel() == v.size(0) * kv_heads && v_scale.numel() == v.size(0) * kv_heads,
              "rotary_write_kv_int8: bad cache");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == qkv.size(0), "rotary_write_kv_int8: one slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < v.size(0), "rotary_write_kv_int8: slot out of range");
  return slots;
}

inline void check_decode_args(const at::Tensor& q, const at::Tensor& k_t, const at::Tensor& k_scale,
                              const at::Tensor& v, const at::Tensor& v_scale, int64_t block_size) {
  TORCH_CHECK(block_size == kBlock, "the int8 KV cache takes blocks of 16 tokens");
  TORCH_CHECK(q.dim() == 3 && k_t.dim() == 4 && v.dim() == 3 && k_t.scalar_type() == at::kChar &&
              v.scalar_type() == at::kChar && k_t.is_contiguous() && v.is_contiguous() &&
              k_scale.is_contiguous() && v_scale.is_contiguous(), "paged_decode_attention_int8: bad cache");
}

// How decode work items, (sequence, KV head) pairs in (sequence, head) order, read the cache: item
// i's units 0 .. 2 nb - 1 are its K blocks, then its V blocks, each 16 rows of D bytes. A kernel
// prefetches, while it computes a unit, the unit `ahead` units on (past the item's end, into the
// next item's), a line at a time.
template <int D>
struct ReadOrder {
  static_assert(D % 64 == 0, "head_dim a multiple of 64: whole cache lines per row");
  const int8_t* k_t;
  const int8_t* v;
  const int64_t* tables;
  const int64_t* lens;
  int64_t kv_heads, max_blocks, items;

  int64_t blocks_of(int64_t item) const {
    const int64_t len = lens[item / kv_heads];
    return len > 0 ? (len + kBlock - 1) / kBlock : 0;
  }

  struct Rows {
    const char* p = nullptr;
    int64_t stride = 0;
    void prefetch(int64_t line) const {  // line 0 .. 16 * D / 64 - 1 of the unit (none past the last item)
      if (p) _mm_prefetch(p + line / (D / 64) * stride + line % (D / 64) * 64, _MM_HINT_T0);
    }
  };

  Rows unit(int64_t item, int64_t u) const {
    int64_t nb = blocks_of(item);
    while (u >= 2 * nb) {
      u -= 2 * nb;
      if (++item >= items) return Rows{};
      nb = blocks_of(item);
    }
    const int64_t s = item / kv_heads, h = item % kv_heads, blk = tables[s * max_blocks + (u < nb ? u : u - nb)];
    if (u < nb) return Rows{reinterpret_cast<const char*>(k_t + (blk * kv_heads + h) * D * kBlock), D};
    return Rows{reinterpret_cast<const char*>(v + (blk * kBlock * kv_heads + h) * D), kv_heads * D};
  }
};

}  // namespace kestrel_int8_kv
