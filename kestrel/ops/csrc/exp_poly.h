// The constants of exp_clamped (simd.h for AVX-512, vec_avx2.h for AVX2), free of any instruction
// set: exp(x) = 2^n * 2^f with n = round(x log2 e), f in [-0.5, 0.5], 2^f = e^(f ln 2) by a degree-6
// polynomial (relative error ~2e-7, float's own rounding), evaluated by Horner's rule from kPoly[0].
// Part of each kernel's build key.
#pragma once

namespace kestrel_simd_exp {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;
constexpr int kPolyTerms = 7;
constexpr float kPoly[kPolyTerms] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

}  // namespace kestrel_simd_exp
