// Shared by Kestrel's CPU kernels (cpu_kernels.cpp, cpu_gemv.cpp, cpu_prefill.cpp): the AMX permission
// check and the tile configuration. Part of each kernel's build key (kestrel/ops/__init__.py hashes the headers).
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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

}  // namespace kestrel_amx
