// The parts of ATen the kernels use, without <torch/extension.h>. That header brings the whole C++ frontend and
// pybind11: ~45 s of parsing per source file on a 2-core Zen 3, most of a first build's 5-6 minutes. These take
// ~5 s. Only bindings.cpp, which needs pybind11, includes the full header.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
