// The vector interface of Kestrel's CPU kernels (every source on it, through isa.h) for AVX2 + FMA
// machines without AVX-512 (most laptops and desktops, AMD Zen 1-3): the names of vec_avx512.h on 8
// lanes, 16 registers (with vec_common.h, the ones whose intrinsics differ only in width). Part of
// each kernel's build key.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the AVX2 build needs AVX2 and FMA"
#endif

namespace kestrel_vec {

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using VecF = __m256;
using VecI = __m256i;
using Mask = __m256;  // all ones in a lane that is in

inline VecI iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline __m128i load_16bit_lanes(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m128i load_8bit_lanes(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
inline VecF round_nearest(VecF v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// n in [-126, 127]: 2^n built straight in the exponent field.
inline VecF times_pow2(VecF v, VecF n) {
  return _mm256_mul_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
}
#define KESTREL_VEC_PS(op) _mm256_##op##_ps
#define KESTREL_VEC_EPI32(op) _mm256_##op##_epi32
#define KESTREL_VEC_SI(op) _mm256_##op##_si256
#define KESTREL_VEC_TO_PS _mm256_castsi256_ps
#include "vec_common.h"
#undef KESTREL_VEC_PS
#undef KESTREL_VEC_EPI32
#undef KESTREL_VEC_SI
#undef KESTREL_VEC_TO_PS

inline void store_bf16(uint16_t* p, VecF v) {
  const __m256i h = _mm256_srli_epi32(round_to_bf16_upper(v), 16);  // each lane < 2^16: packus is exact
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
// 2 x kLanes bytes widened into as many 16-bit lanes; 16-bit lane operations; pairs of 16-bit products
// summed into 32-bit lanes (vpmaddwd).
inline VecI load_u8_words(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VecI load_i8_words(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Two rows of 16 int8 interleaved into 16 pairs (row0[c], row1[c]) widened to 16-bit lanes: vector v
// (columns 8v .. 8v + 7), as load_i8_words reads rows interleaved in memory.
inline VecI load_i8_pair_words(const int8_t* row0, const int8_t* row1, int v) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row1));
  return _mm256_cvtepi8_epi16(v == 0 ? _mm_unpacklo_epi8(a, b) : _mm_unpackhi_epi8(a, b));
}
inline VecI low_nibble_words(VecI w) { return _mm256_and_si256(w, _mm256_set1_epi16(15)); }
inline VecI low_nibble_bytes(VecI w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
inline VecI high_nibble_bytes(VecI w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15)); }
inline VecI shift_left_lanes(VecI v, int n) { return _mm256_slli_epi32(v, n); }
inline VecI high_nibble_words(VecI w) { return _mm256_srli_epi16(w, 4); }
// w with 16 added to word i where bit i of bits is set (a 5-bit q's fifth bit; bits 16 and up unread).
inline VecI with_fifth_bits(VecI w, uint32_t bits) {
  const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                           static_cast<int16_t>(0x8000));
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), select), select);
  return _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi16(16)));
}
// w with the bits Mask of each byte taken from h shifted left by Shift (right where negative; in 16-bit
// lanes, the bits crossing bytes masked off): a 6-bit q's two high bits (0x30), or a 5-bit q's fifth
// (0x10), put above its low nibble.
template <int Shift, int Mask>
inline VecI with_high_bits(VecI w, VecI h) {
  VecI shifted = h;
  if constexpr (Shift > 0) shifted = _mm256_slli_epi16(h, Shift);
  if constexpr (Shift < 0) shifted = _mm256_srli_epi16(h, -Shift);
  return _mm256_or_si256(w, _mm256_and_si256(shifted, _mm256_set1_epi8(Mask)));
}
inline VecI madd_words(VecI a, VecI b) { return _mm256_madd_epi16(a, b); }
// acc plus the pairs of 16-bit products of a and b summed into 32-bit lanes: one vpdpwssd where the
// build targets AVX-VNNI, else vpmaddwd and an add. The same integers either way (neither saturates).
inline VecI add_word_products(VecI acc, VecI a, VecI b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
inline VecI add_lanes(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI zero_i() { return _mm256_setzero_si256(); }
inline VecF to_float_lanes(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecI low_words(VecI v) { return _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)); }
inline VecI high_words(VecI v) { return _mm256_srli_epi32(v, 16); }
// Each lane rounded to an integer (to nearest even) and stored as int16 (|v| < 2^15).
inline void store_int16_rounded(int16_t* p, VecF v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(i, i), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// Bytes: kLanes x 4 of them from p; pairs of unsigned x signed byte products summed into 16-bit lanes
// (vpmaddubsw: each sum saturates past +-32767, which the caller rules out); 16-bit lane sums.
inline VecI load_bytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
// q's bytes 4c + t (column c's k-rows t = 0 .. 3) as pairs: bytes 2c + t of k-rows 0 and 1 to `first`,
// of k-rows 2 and 3 to `second` (2 kLanes bytes each).
inline void store_byte_pairs(VecI q, uint8_t* first, uint8_t* second) {
  const __m256i halves = _mm256_shuffle_epi8(q, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m256i pairs = _mm256_permute4x64_epi64(halves, 0xD8);   // quads 0, 2, 1, 3
  _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(pairs));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm256_extracti128_si256(pairs, 1));
}
inline VecI madd_bytes(VecI u8, VecI s8) { return _mm256_maddubs_epi16(u8, s8); }
inline VecI add_words(VecI a, VecI b) { return _mm256_add_epi16(a, b); }
// Whether add_byte_products is one instruction (vpdpbusd: the four u8 x s8 products of each 32-bit
// lane summed exactly into it); without it, callers sum pairs in 16 bits first (vpmaddubsw).
#if defined(__AVXVNNI__)
constexpr bool kFusedByteProducts = true;
inline VecI add_byte_products(VecI acc, VecI u8, VecI s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else
constexpr bool kFusedByteProducts = false;
inline VecI add_byte_products(VecI acc, VecI u8, VecI s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
#endif
// Each lane rounded to an integer (to nearest even) and stored as int8 (|v| <= 127): kLanes bytes.
inline void store_int8_rounded(int8_t* p, VecF v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}
inline VecF abs(VecF v) { return _mm256_andnot_ps(splat(-0.f), v); }
inline float hsum(VecF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(VecF v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums in 3 hadds and one add.
inline __m128 hsum4(VecF a0, VecF a1, VecF a2, VecF a3) {
  const VecF t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Lanes i < n (n may be <= 0 or >= kLanes).
inline Mask lanes_below(int64_t n) {
  const int32_t m = static_cast<int32_t>(std::max<int64_t>(-1, std::min<int64_t>(n, kLanes)));
  return from_bits(_mm256_cmpgt_epi32(splat_i(m), iota()));
}
inline VecF load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, bits(lanes_below(n))); }  // others 0
inline VecF keep(Mask m, VecF v) { return _mm256_and_ps(m, v); }  // 0 outside m
inline VecF select(Mask m, VecF yes, VecF no) { return _mm256_blendv_ps(no, yes, m); }
inline VecI select_i(Mask m, VecI yes, VecI no) { return _mm256_blendv_epi8(no, yes, bits(m)); }
inline Mask greater(VecF a, VecF b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask is_nan(VecF v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
inline Mask either(Mask a, Mask b) { return _mm256_or_ps(a, b); }
inline bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
inline VecF gather_strided(const float* p, int64_t stride) { return _mm256_i32gather_ps(p, strided(stride), 4); }

// Keeps a loaded vector in a register. Without it, GCC tuning for Zen 3 folds the loads into the
// FMAs as memory operands: 16 loads per 12 FMAs instead of 7 in linear_f32's tile, which leaves it
// bound by the load ports.
inline VecF in_register(VecF v) {
  asm("" : "+x"(v));
  return v;
}
inline VecI in_register_i(VecI v) {
  asm("" : "+x"(v));
  return v;
}
inline void keep_in_register(VecI& v) { asm("" : "+x"(v)); }

// One k-row of a packed bf16 panel (16 columns; the layout of linear_float.cpp's "packed bf16
// weights": 32-bit word j holds column j in its low half and column j + 8 in its high half) widened
// to float32: b[0] columns 0-7 by a shift, b[1] columns 8-15 by a mask. One load and two ALU ops feed
// 12 FMAs of the 6 x 16 tile, where widening 8 bf16 at a time takes a zero-extending shuffle and a
// shift for each 8.
inline void load_panel_row(const uint16_t* p, VecF b[2]) {
  __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  asm("" : "+x"(w));  // one load for both halves, not one folded into each op
  b[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  b[1] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// A rounded product: the empty asm makes the compiler materialise it, so that it is never contracted
// with the following add into an FMA, and the result rounds exactly as torch's separate
// `x * cos + rotate_half(x) * sin` does.
inline VecF mul_exact(VecF a, VecF b) {
  VecF p = mul(a, b);
  asm("" : "+x"(p));
  return p;
}
inline VecF add_exact(VecF a, VecF b) { return add(a, b); }

// r[i] lane j <-> r[j] lane i: kLanes (8) rows of 8 floats transposed in registers.
inline void transpose_lanes(VecF r[kLanes]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

}  // namespace kestrel_vec
