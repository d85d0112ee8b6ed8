// The part of the vector interface (vec_avx512.h, vec_avx2.h) whose intrinsics differ only in their
// width, written once. Each of those headers defines, inside namespace kestrel_vec, VecF (kLanes
// float32 lanes), VecI (as many int32 lanes), iota() and the intrinsic names at its width:
// KESTREL_VEC_PS(op) (_mm512_add_ps), KESTREL_VEC_EPI32(op) (_mm512_add_epi32), KESTREL_VEC_SI(op)
// (_mm512_and_si512) and KESTREL_VEC_TO_PS (_mm512_castsi512_ps); then it includes this file.
// Part of each kernel's build key.

#include "exp_poly.h"

inline VecF load_f32(const float* p) { return KESTREL_VEC_PS(loadu)(p); }
inline void store(float* p, VecF v) { KESTREL_VEC_PS(storeu)(p, v); }
inline VecF zero() { return KESTREL_VEC_PS(setzero)(); }
inline VecF splat(float x) { return KESTREL_VEC_PS(set1)(x); }
inline VecF add(VecF a, VecF b) { return KESTREL_VEC_PS(add)(a, b); }
inline VecF sub(VecF a, VecF b) { return KESTREL_VEC_PS(sub)(a, b); }
inline VecF mul(VecF a, VecF b) { return KESTREL_VEC_PS(mul)(a, b); }
inline VecF div(VecF a, VecF b) { return KESTREL_VEC_PS(div)(a, b); }
inline VecF max(VecF a, VecF b) { return KESTREL_VEC_PS(max)(a, b); }
inline VecF fma(VecF a, VecF b, VecF c) { return KESTREL_VEC_PS(fmadd)(a, b, c); }
inline VecF fmsub(VecF a, VecF b, VecF c) { return KESTREL_VEC_PS(fmsub)(a, b, c); }  // a * b - c, rounded once
inline VecF fnmadd(VecF a, VecF b, VecF c) { return KESTREL_VEC_PS(fnmadd)(a, b, c); }  // c - a * b, rounded once

inline VecF min(VecF a, VecF b) { return KESTREL_VEC_PS(min)(a, b); }

inline VecI bits(VecF v) { return KESTREL_VEC_SI(castps)(v); }
inline VecF from_bits(VecI b) { return KESTREL_VEC_TO_PS(b); }
inline VecI splat_i(int32_t x) { return KESTREL_VEC_EPI32(set1)(x); }
inline VecI add_i(VecI a, int32_t b) { return KESTREL_VEC_EPI32(add)(a, splat_i(b)); }
inline VecI mul_lanes(VecI a, VecI b) { return KESTREL_VEC_EPI32(mullo)(a, b); }  // the low 32 bits of each product
inline void store_i(int32_t* p, VecI v) { KESTREL_VEC_SI(storeu)(reinterpret_cast<VecI*>(p), v); }
// Each lane rounded to int32 in the current rounding mode (to nearest even by default).
inline void store_rounded(int32_t* p, VecF v) { store_i(p, KESTREL_VEC_EPI32(cvtps)(v)); }
// The lane offsets 0, stride, 2 stride, ... (for a gather).
inline VecI strided(int64_t stride) { return mul_lanes(iota(), splat_i(static_cast<int32_t>(stride))); }

// float → bf16 with round-to-nearest-even, as torch's .to(torch.bfloat16) does: the bf16 value sits
// in the upper 16 bits of each lane of the result.
inline VecI round_to_bf16_upper(VecF v) {
  const VecI b = bits(v);
  const VecI lsb = KESTREL_VEC_SI(and)(KESTREL_VEC_EPI32(srli)(b, 16), splat_i(1));
  return KESTREL_VEC_EPI32(add)(b, KESTREL_VEC_EPI32(add)(splat_i(0x7FFF), lsb));
}
inline VecF bf16_round_trip(VecF v) {  // float → bf16 → float
  return from_bits(KESTREL_VEC_SI(and)(round_to_bf16_upper(v), splat_i(static_cast<int32_t>(0xFFFF0000u))));
}
inline VecF negate(VecF v) {  // exactly torch's neg, signed zeros included
  return from_bits(KESTREL_VEC_SI(xor)(bits(v), splat_i(static_cast<int32_t>(0x80000000u))));
}

inline VecF load_bf16(const uint16_t* p) {
  return from_bits(KESTREL_VEC_EPI32(slli)(KESTREL_VEC_EPI32(cvtepu16)(load_16bit_lanes(p)), 16));
}
inline VecF load_int8(const int8_t* p) { return KESTREL_VEC_PS(cvtepi32)(KESTREL_VEC_EPI32(cvtepi8)(load_8bit_lanes(p))); }
inline VecI load_uint8_lanes(const uint8_t* p) { return KESTREL_VEC_EPI32(cvtepu8)(load_8bit_lanes(p)); }
inline VecF load_uint8(const uint8_t* p) { return KESTREL_VEC_PS(cvtepi32)(load_uint8_lanes(p)); }

// exp(x), x clamped to [-87, 88]: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], 2^f by the degree-6
// polynomial of exp_poly.h (relative error ~2e-7, float's own rounding).
inline VecF exp_clamped(VecF x) {
  using namespace kestrel_simd_exp;
  x = min(max(x, splat(-87.f)), splat(88.f));
  const VecF t = mul(x, splat(kLog2e));
  const VecF n = round_nearest(t);
  const VecF f = mul(sub(t, n), splat(kLn2));  // f ln 2
  VecF p = splat(kPoly[0]);
  for (int i = 1; i < kPolyTerms; ++i) p = fma(p, f, splat(kPoly[i]));
  return times_pow2(p, n);
}
