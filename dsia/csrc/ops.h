// casspec's own CPU ops (ops.cpp: a float32 forward's small steps; blockq.cpp: block-quantized products), shared
// by the C++ layer loop (layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace casspec {

constexpr int64_t kParallelWork = 1 << 18;  // an attention or a block product of more multiply-adds than this runs
                                            // on every thread (fewer: waking the other costs more)

// RMSNorm of x [T, D] (float32) with weight [D]: [T, D]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// (x + delta, its RMSNorm), [T, D] each
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
// RoPE of x [heads, T, hd] with cos [T, hd] and the signed sin [T, hd]: [heads, T, hd], contiguous
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// x [T, K] float32 times GGUF-style blocks as stored (blockq.cpp) for n outputs: [T, n]
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                        int64_t isa);
// attention of q [H, T, hd] over keys, values [Hkv, S, hd] at slots [0, end): row t sees the slots where mask [T,
// end] is true, or (no mask) slots [0, end - T + t]; scores scaled by `scale`. Returns [T, H*hd].
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t end,
                     const std::optional<at::Tensor>& mask, double scale);

}  // namespace casspec
