// The part of PyTorch's C++ API the kernels use: at::Tensor, at::empty / empty_like / add,
// at::parallel_for and pybind11 with torch's tensor casters, not torch/extension.h (the whole C++
// frontend: autograd, nn, optim), which takes far longer to parse in every source.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
