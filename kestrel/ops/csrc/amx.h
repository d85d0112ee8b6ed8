// Shared by Kestrel's AMX kernels (decode_bf16_avx512.h, linear_bf16_avx512.cpp, prefill_attention.cpp):
// the AMX permission check and the tile configuration. Part of each kernel's build key
// (kestrel/ops/build.py follows the includes).
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <type_traits>

namespace kestrel_amx {

// Whether this CPU has AMX-BF16 and the process may use AMX tile data (Linux grants it on request,
// ARCH_REQ_XCOMP_PERM, once per process).
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

// The 64-byte operand of LDTILECFG (palette 1): bytes per row and rows of each tile register.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile instructions on a register number given as a template argument (the intrinsics take a
// literal one): tmm(R) loaded from / stored to rows `stride` bytes apart, zeroed; tmm(C) += tmm(A) .
// tmm(B) in bf16 pairs (tdpbf16ps, as _tile_dpbf16ps(C, A, B)).
template <int R>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("{tileloadd\t(%0,%1,1), %%tmm%c2|tileloadd\t%%tmm%c2, [%0+%1*1]}" : : "r"(base), "r"(stride), "i"(R));
}
template <int R>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("{tilestored\t%%tmm%c2, (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm%c2}"
               : : "r"(base), "r"(stride), "i"(R) : "memory");
}
template <int R>
inline void tile_zero() {
  asm volatile("tilezero\t%%tmm%c0" : : "i"(R));
}
template <int C, int A, int B>
inline void tile_dot_bf16() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
}
template <int R>
constexpr std::integral_constant<int, R> kReg{};  // a tile register number, passed to a generic lambda

}  // namespace kestrel_amx
