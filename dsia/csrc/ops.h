// A float32 forward's small steps on the CPU (ops.cpp), shared by the C++ layer loop (layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace casspec {

constexpr int64_t kParallelWork = 1 << 18;  // an attention of more multiply-adds than this runs on every thread

// RMSNorm of x [T, D] (float32) with weight [D]: [T, D]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// (x + delta, its RMSNorm), [T, D] each
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
// RoPE of x [heads, T, hd] with cos [T, hd] and the signed sin [T, hd]: [heads, T, hd], contiguous
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// attention of q [H, T, hd] over keys, values [Hkv, S, hd] at slots [0, end): row t sees the slots where mask [T,
// end] is true, or (no mask) slots [0, end - T + t]; scores scaled by `scale`. Returns [T, H*hd].
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t end,
                     const std::optional<at::Tensor>& mask, double scale);

}  // namespace casspec
