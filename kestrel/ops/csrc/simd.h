// AVX-512 helpers of Kestrel's AMX kernels (linear_bf16_avx512.cpp, prefill_attention.cpp), beside the
// vector interface of vec_avx512.h. Part of each kernel's build key (kestrel/ops/build.py follows the
// includes).
#pragma once

#include <immintrin.h>

#include "vec_avx512.h"

namespace kestrel_simd {

// exp(x), x clamped to [-87, 88] (vec_common.h).
using kestrel_vec::exp_clamped;

// float32 → bf16 bits (in the low half of each lane), to nearest even; NaN stays a quiet NaN.
inline __m512i round_to_bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
}

// 16 x 16 transpose of 32-bit elements, in registers (vec_avx512.h).
using kestrel_vec::transpose16;

}  // namespace kestrel_simd
