// The part of PyTorch's C++ API the kernels use: at::Tensor, at::empty / empty_like / add,
// at::parallel_for and pybind11 with torch's tensor casters. torch/extension.h (the whole C++
// frontend: autograd, nn, optim) took 20 s of each source's compile to parse on 2 cores; these 7.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
