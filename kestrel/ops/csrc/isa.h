// The one header that picks this build's instruction set. Each extension is built for one ISA
// (kestrel/ops/build.py): KESTREL_VEC_AVX512 (-march=native on an AVX-512 CPU: 16 lanes, 32
// registers) or KESTREL_VEC_AVX2 (x86-64-v3: 8 lanes, 16 registers). Every source includes this
// header, never a vector header directly, and asks the KESTREL_HAS_* macros below what the build
// can run beyond its vector interface.
#pragma once

#if defined(KESTREL_VEC_AVX512)
#include "vec_avx512.h"
#elif defined(KESTREL_VEC_AVX2)
#include "vec_avx2.h"
#else
#error "build with -DKESTREL_VEC_AVX512 or -DKESTREL_VEC_AVX2 (kestrel/ops/build.py does)"
#endif

// AVX512-BF16 (vdpbf16ps): the bf16 dot-product kernels and, with AMX, the tile kernels.
#if defined(KESTREL_VEC_AVX512) && defined(__AVX512BF16__)
#define KESTREL_HAS_AVX512_BF16 1
#endif

// AVX512-VNNI with BW on the AVX-512 build, or the AVX2 build: linear_int8's exact int8 products.
#if (defined(KESTREL_VEC_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(KESTREL_VEC_AVX2)
#define KESTREL_HAS_INT8_LINEAR 1
#endif
