// The vector interface of Kestrel's CPU kernels (every source on it, through isa.h) for AVX-512: a
// float vector of kLanes = 16 lanes and the few operations the kernels are written on (with
// vec_common.h, the ones whose intrinsics differ only in width). vec_avx2.h defines the same names for
// 8 lanes; every source is compiled once with each (KESTREL_VEC_AVX512 or KESTREL_VEC_AVX2: one
// extension per ISA, kestrel/ops/build.py; isa.h picks the header). Part of each kernel's build key.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX512F__)
#error "the AVX-512 build needs AVX-512 (-march=native on an AVX-512 CPU)"
#endif

namespace kestrel_vec {

constexpr int kLanes = 16;
constexpr int kRegisters = 32;  // vector registers: what the kernels' register tiles may hold
using VecF = __m512;
using VecI = __m512i;
using Mask = __mmask16;  // one bit a lane

inline VecI iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m256i load_16bit_lanes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load_8bit_lanes(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline VecF round_nearest(VecF v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF times_pow2(VecF v, VecF n) { return _mm512_scalef_ps(v, n); }
#define KESTREL_VEC_PS(op) _mm512_##op##_ps
#define KESTREL_VEC_EPI32(op) _mm512_##op##_epi32
#define KESTREL_VEC_SI(op) _mm512_##op##_si512
#define KESTREL_VEC_TO_PS _mm512_castsi512_ps
#include "vec_common.h"
#undef KESTREL_VEC_PS
#undef KESTREL_VEC_EPI32
#undef KESTREL_VEC_SI
#undef KESTREL_VEC_TO_PS

inline void store_bf16(uint16_t* p, VecF v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_upper(v), 16)));
}
// One k-row of a packed bf16 panel (16 columns; 32-bit word j holds column j in its low half and
// column j + 8 in its high half, the layout vec_avx2.h widens by a shift and a mask) widened to
// float32 in column order: the two halves joined in one 16-lane vector.
inline void load_panel_row(const uint16_t* p, VecF b[1]) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low = _mm256_slli_epi32(w, 16);
  const __m256i high = _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  b[0] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
}
// 2 x kLanes bytes widened into as many 16-bit lanes; 16-bit lane operations; pairs of 16-bit products
// summed into 32-bit lanes (vpmaddwd).
inline VecI load_u8_words(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VecI load_i8_words(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// Two rows of 16 int8 interleaved into 16 pairs (row0[c], row1[c]) widened to 16-bit lanes: vector v of
// 2 kLanes lanes (here the only one, v = 0), as load_i8_words reads rows interleaved in memory.
inline VecI load_i8_pair_words(const int8_t* row0, const int8_t* row1, int /*v*/) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row1));
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
}
inline VecI low_nibble_words(VecI w) { return _mm512_and_si512(w, _mm512_set1_epi16(15)); }
inline VecI low_nibble_bytes(VecI w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
inline VecI high_nibble_bytes(VecI w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15)); }
inline VecI shift_left_lanes(VecI v, int n) { return _mm512_slli_epi32(v, n); }
inline VecI high_nibble_words(VecI w) { return _mm512_srli_epi16(w, 4); }
// w with 16 added to word i where bit i of bits is set (a 5-bit q's fifth bit).
inline VecI with_fifth_bits(VecI w, uint32_t bits) {
  return _mm512_mask_add_epi16(w, static_cast<__mmask32>(bits), w, _mm512_set1_epi16(16));
}
// w with the bits Mask of each byte taken from h shifted left by Shift (right where negative; in 16-bit
// lanes, the bits crossing bytes masked off): a 6-bit q's two high bits (0x30), or a 5-bit q's fifth
// (0x10), put above its low nibble. One vpternlogd: w | (shifted & Mask).
template <int Shift, int Mask>
inline VecI with_high_bits(VecI w, VecI h) {
  VecI shifted = h;
  if constexpr (Shift > 0) shifted = _mm512_slli_epi16(h, Shift);
  if constexpr (Shift < 0) shifted = _mm512_srli_epi16(h, -Shift);
  return _mm512_ternarylogic_epi32(w, shifted, _mm512_set1_epi8(Mask), 0xF8);   // a | (b & c)
}
inline VecI madd_words(VecI a, VecI b) { return _mm512_madd_epi16(a, b); }
// acc plus the pairs of 16-bit products of a and b summed into 32-bit lanes: one vpdpwssd where the
// CPU has AVX512-VNNI, else vpmaddwd and an add. The same integers either way (neither saturates).
inline VecI add_word_products(VecI acc, VecI a, VecI b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
inline VecI add_lanes(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI zero_i() { return _mm512_setzero_si512(); }
inline VecF to_float_lanes(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecI low_words(VecI v) { return _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)); }
inline VecI high_words(VecI v) { return _mm512_srli_epi32(v, 16); }
// Each lane rounded to an integer (to nearest even) and stored as int16 (|v| < 2^15).
inline void store_int16_rounded(int16_t* p, VecF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
}
inline VecI load_bytes(const void* p) { return _mm512_loadu_si512(p); }
// q's bytes 4c + t (column c's k-rows t = 0 .. 3) as pairs: bytes 2c + t of k-rows 0 and 1 to `first`,
// of k-rows 2 and 3 to `second` (2 kLanes bytes each).
inline void store_byte_pairs(VecI q, uint8_t* first, uint8_t* second) {
  const __m512i halves = _mm512_shuffle_epi8(q, _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)));
  const __m512i pairs = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), halves);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(first), _mm512_castsi512_si256(pairs));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(second), _mm512_extracti64x4_epi64(pairs, 1));
}
inline VecI madd_bytes(VecI u8, VecI s8) { return _mm512_maddubs_epi16(u8, s8); }
inline VecI add_words(VecI a, VecI b) { return _mm512_add_epi16(a, b); }
// Whether add_byte_products is one instruction (vpdpbusd: the four u8 x s8 products of each 32-bit
// lane summed exactly into it); without it, callers sum pairs in 16 bits first (vpmaddubsw).
#if defined(__AVX512VNNI__)
constexpr bool kFusedByteProducts = true;
inline VecI add_byte_products(VecI acc, VecI u8, VecI s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
#else
constexpr bool kFusedByteProducts = false;
inline VecI add_byte_products(VecI acc, VecI u8, VecI s8) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
}
#endif
inline void store_int8_rounded(int8_t* p, VecF v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
inline VecF abs(VecF v) { return _mm512_abs_ps(v); }
inline float hsum(VecF v) { return _mm512_reduce_add_ps(v); }
inline float hmax(VecF v) { return _mm512_reduce_max_ps(v); }

// [sum(a0), sum(a1), sum(a2), sum(a3)]: the two halves of each added, then as in vec_avx2.h.
inline __m128 hsum4(VecF a0, VecF a1, VecF a2, VecF a3) {
  const auto half = [](VecF v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Lanes i < n (n may be <= 0 or >= kLanes).
inline Mask lanes_below(int64_t n) { return n >= kLanes ? Mask(0xFFFF) : n <= 0 ? Mask(0) : Mask((1u << n) - 1); }
inline VecF load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes_below(n), p); }  // others 0
inline VecF keep(Mask m, VecF v) { return _mm512_maskz_mov_ps(m, v); }  // 0 outside m
inline VecF select(Mask m, VecF yes, VecF no) { return _mm512_mask_blend_ps(m, no, yes); }
inline VecI select_i(Mask m, VecI yes, VecI no) { return _mm512_mask_mov_epi32(no, m, yes); }
inline Mask greater(VecF a, VecF b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask is_nan(VecF v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline Mask either(Mask a, Mask b) { return a | b; }
inline bool any(Mask m) { return m != 0; }
inline VecF gather_strided(const float* p, int64_t stride) { return _mm512_i32gather_ps(strided(stride), p, 4); }

// Keeps a loaded vector in a register (the compiler would otherwise fold the load into each FMA
// that reads it, as a memory operand).
inline VecF in_register(VecF v) {
  asm("" : "+v"(v));
  return v;
}
inline VecI in_register_i(VecI v) {
  asm("" : "+v"(v));
  return v;
}
inline void keep_in_register(VecI& v) { asm("" : "+v"(v)); }

// Rounded multiply and add: the _round_ forms are never contracted into an FMA, so the result
// rounds exactly as torch's separate `x * cos + rotate_half(x) * sin` does.
inline VecF mul_exact(VecF a, VecF b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF add_exact(VecF a, VecF b) { return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// 16 x 16 transpose of 32-bit elements, in registers: r[i] lane j ↔ r[j] lane i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// r[i] lane j <-> r[j] lane i: kLanes rows of kLanes floats transposed in registers.
inline void transpose_lanes(VecF r[kLanes]) {
  __m512i t[16];
  for (int i = 0; i < 16; ++i) t[i] = _mm512_castps_si512(r[i]);
  transpose16(t);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(t[i]);
}

}  // namespace kestrel_vec
