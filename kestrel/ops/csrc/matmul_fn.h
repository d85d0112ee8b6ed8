// The one signature by which a C++ layer loop (decode_layers.cpp's DecodeLayers) calls a matmul by
// its address: y = x w^T (x [M, K], w [N, K]; y in x's dtype). The extension exports its matmuls'
// addresses as `matmul_address(name)` (bindings.cpp); it stays loaded for the life of the process
// (kestrel.ops.cpu_kernels caches it), so an address stays valid. Part of each kernel's build key
// (kestrel/ops/build.py follows the includes).
#pragma once

#include "torch_api.h"

#include <cstdint>

namespace kestrel_matmul {

using MatmulFn = at::Tensor (*)(const at::Tensor& x, const at::Tensor& w);

// One thread's share of a bf16 y = x w^T (x [M, K], w [N, K], y [M, N], 1 <= M < kSliceMaxRows),
// computed on the calling thread inside a layer loop's own parallel region: the output columns
// [n_begin, n_end), which are multiples of kSliceColumns (n_end may be N). Each output is the same sum
// in the same order as the module's whole matmul gives it, so the shares make the same y.
using MatmulSliceFn = void (*)(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                               int64_t n_begin, int64_t n_end);
constexpr int64_t kSliceMaxRows = 16;
constexpr int64_t kSliceColumns = 16;

}  // namespace kestrel_matmul
