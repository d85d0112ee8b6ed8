// The one signature by which a C++ layer loop (cpu_kernels.cpp's DecodeLayers) calls a matmul of
// another kernel module: y = x w^T (x [M, K], w [N, K]; y in x's dtype). A module exports its matmuls'
// addresses as `matmul_address(name)`. Both modules are built by the same compiler against the same
// torch and stay loaded for the life of the process (kestrel/ops caches them), so an address stays
// valid. Part of each kernel's build key (kestrel/ops/__init__.py hashes the headers).
#pragma once

#include <torch/extension.h>

namespace kestrel_matmul {

using MatmulFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& w);

}  // namespace kestrel_matmul
