// The AVX-512 intrinsics kestrel/ops' kernels use that SIMDe 0.7.4 lacks, written lane by lane as Intel's
// manual defines them (kshim_ names; aliases.py maps the _mm512_ names onto them).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <simde/x86/avx512.h>

#define KSHIM_UNPACK(T, n, name, v) T name[n]; std::memcpy(name, &(v), sizeof(name))
#define KSHIM_PACK(R, name) R r_; std::memcpy(&r_, name, sizeof(r_)); return r_

// Not inlined: a product or sum that must round on its own, never fused into an FMA by the compiler.
__attribute__((noinline)) static simde__m512 kshim_mm512_mul_round_ps(simde__m512 a, simde__m512 b, int) {
  KSHIM_UNPACK(float, 16, x, a); KSHIM_UNPACK(float, 16, y, b);
  for (int i = 0; i < 16; ++i) x[i] = x[i] * y[i];
  KSHIM_PACK(simde__m512, x);
}
__attribute__((noinline)) static simde__m512 kshim_mm512_add_round_ps(simde__m512 a, simde__m512 b, int) {
  KSHIM_UNPACK(float, 16, x, a); KSHIM_UNPACK(float, 16, y, b);
  for (int i = 0; i < 16; ++i) x[i] = x[i] + y[i];
  KSHIM_PACK(simde__m512, x);
}
// Lane i of `a`, as From, converted to To (C++'s conversion: the low bits of a narrower integer).
template <typename To, typename From, int N, typename R, typename A>
static inline R kshim_convert(A a) {
  KSHIM_UNPACK(From, N, x, a); To y[N];
  for (int i = 0; i < N; ++i) y[i] = static_cast<To>(x[i]);
  KSHIM_PACK(R, y);
}
static inline __m256i kshim_mm512_cvtepi32_epi16(simde__m512i a) { return kshim_convert<int16_t, int32_t, 16, __m256i>(a); }
static inline simde__m512 kshim_mm512_cvtepi32_ps(simde__m512i a) { return kshim_convert<float, int32_t, 16, simde__m512>(a); }
static inline simde__m512i kshim_mm512_cvtepu8_epi16(__m256i a) { return kshim_convert<uint16_t, uint8_t, 32, simde__m512i>(a); }
static inline simde__m512i kshim_mm512_cvtepu16_epi32(__m256i a) { return kshim_convert<uint32_t, uint16_t, 16, simde__m512i>(a); }
static inline simde__m512i kshim_mm512_cvtepi8_epi32(__m128i a) { return kshim_convert<int32_t, int8_t, 16, simde__m512i>(a); }
static inline simde__m512i kshim_mm512_cvtepu8_epi32(__m128i a) { return kshim_convert<int32_t, uint8_t, 16, simde__m512i>(a); }
static inline simde__m512i kshim_mm512_cvtps_epi32(simde__m512 a) {
  KSHIM_UNPACK(float, 16, x, a); int32_t y[16];
  for (int i = 0; i < 16; ++i) {
    const float r = std::nearbyint(x[i]);  // the current rounding mode: to nearest even
    y[i] = (std::isnan(r) || r >= 2147483648.0f || r < -2147483648.0f) ? INT32_MIN : (int32_t)r;
  }
  KSHIM_PACK(simde__m512i, y);
}
static inline simde__m512 kshim_mm512_i32gather_ps(simde__m512i index, const void* base, int scale) {
  KSHIM_UNPACK(int32_t, 16, x, index); float y[16];
  for (int i = 0; i < 16; ++i) std::memcpy(&y[i], (const char*)base + (int64_t)x[i] * scale, 4);
  KSHIM_PACK(simde__m512, y);
}
static inline simde__m512 kshim_mm512_maskz_loadu_ps(simde__mmask16 k, const void* p) {
  float y[16];
  for (int i = 0; i < 16; ++i) {
    y[i] = 0.0f;
    if (k >> i & 1) std::memcpy(&y[i], (const char*)p + 4 * i, 4);
  }
  KSHIM_PACK(simde__m512, y);
}
static inline simde__m512 kshim_mm512_permute_ps(simde__m512 a, int imm) {
  KSHIM_UNPACK(float, 16, x, a); float y[16];
  for (int i = 0; i < 16; ++i) y[i] = x[(i & ~3) + ((imm >> (2 * (i & 3))) & 3)];
  KSHIM_PACK(simde__m512, y);
}
// GCC's sequence (avx512fintrin.h): halves, then quarters, then pairs.
template <typename Op>
static inline float kshim_reduce(simde__m512 a, Op op) {
  KSHIM_UNPACK(float, 16, x, a); float t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = op(x[8 + i], x[i]);
  for (int i = 0; i < 4; ++i) t6[i] = op(t3[4 + i], t3[i]);
  const float t80 = op(t6[0], t6[2]), t81 = op(t6[1], t6[3]);
  return op(t80, t81);
}
static inline float kshim_mm512_reduce_add_ps(simde__m512 a) {
  return kshim_reduce(a, [](float p, float q) { return p + q; });
}
static inline float kshim_mm512_reduce_max_ps(simde__m512 a) {
  // maxps: the second operand when either is NaN or both are zero.
  return kshim_reduce(a, [](float p, float q) { return p > q ? p : q; });
}
static inline void kshim_mm512_mask_storeu_epi32(void* p, simde__mmask16 k, simde__m512i a) {
  KSHIM_UNPACK(int32_t, 16, x, a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy((char*)p + 4 * i, &x[i], 4);
}
static inline void kshim_mm256_mask_storeu_epi16(void* p, simde__mmask16 k, __m256i a) {
  KSHIM_UNPACK(int16_t, 16, x, a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy((char*)p + 2 * i, &x[i], 2);
}
static inline simde__mmask16 kshim_mm512_cmplt_epi32_mask(simde__m512i a, simde__m512i b) {
  KSHIM_UNPACK(int32_t, 16, x, a); KSHIM_UNPACK(int32_t, 16, y, b);
  simde__mmask16 k = 0;
  for (int i = 0; i < 16; ++i) k |= (simde__mmask16)((x[i] < y[i]) << i);
  return k;
}
// vcvtne2ps2bf16: to nearest even, denormals in and out flushed to zero, NaN kept quiet; b's 16 lanes
// below a's.
static inline uint16_t kshim_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline simde__m512bh kshim_mm512_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  KSHIM_UNPACK(float, 16, x, a); KSHIM_UNPACK(float, 16, y, b); uint16_t r[32];
  for (int i = 0; i < 16; ++i) {
    r[i] = kshim_to_bf16(y[i]);
    r[16 + i] = kshim_to_bf16(x[i]);
  }
  KSHIM_PACK(simde__m512bh, r);
}
// vmovntdqa: a load (the non-temporal hint aside), which faults unless the address is 64-byte aligned.
static inline simde__m512i kshim_mm512_stream_load_si512(void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 64 != 0) __builtin_trap();
  simde__m512i r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
