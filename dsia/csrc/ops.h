// casspec's own CPU ops (ops.cpp: a float32 forward's small steps; blockq.cpp: block-quantized products), shared
// by the C++ layer loop (layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace casspec {

constexpr int64_t kMaxHeadDim = 256;  // the widest attention head the ops take (16 chunks of 16 floats)
// The instruction sets the ops have paths for, each path the same bits as the others (ISA: -1 the widest this CPU
// runs). machine_isa(): that widest path (AVX-512: avx512f; AVX2: avx2 and fma), capped by the environment's
// CASSPEC_ISA (plain | avx2 | avx512) where it is set, so any machine can run the plain path (tests, CI).
enum Isa : int64_t { kAuto = -1, kPlain = 0, kAvx2 = 1, kAvx512 = 2 };
Isa machine_isa();

constexpr int64_t kParallelWork = 1 << 18;  // an attention or a block product of more multiply-adds than this runs
                                            // on every thread (fewer: waking the other costs more)

// Every op checks each tensor argument before it reads one: dtype, device, dims, the sizes it indexes and unit
// strides where it reads rows directly (an untrusted model file or a caller's mistake gives an error, never a read
// outside a tensor or a trap). `what` names the op and the argument in the error.
inline void check_tensor(const at::Tensor& t, const char* what, at::ScalarType dtype, int64_t dims) {
  TORCH_CHECK(t.defined(), "casspec ", what, ": a tensor is required");
  TORCH_CHECK(t.scalar_type() == dtype, "casspec ", what, ": ", c10::toString(dtype), " expected, got ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(t.device().is_cpu(), "casspec ", what, ": a CPU tensor expected, got one on ", t.device().str());
  TORCH_CHECK(t.dim() == dims, "casspec ", what, ": ", dims, " dims expected, got ", t.dim());
}

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
// x [T, K] float32 times w [N, K] float32 (+ bias [N]) by casspec's own kernel (dense.cpp): [T, N], each row the
// same bits whatever the rows beside it and the instruction set (isa -1: the best this CPU has)
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t isa);
// attention of q [H, T, hd] over keys, values [Hkv, S, hd] at slots [0, end): row t sees the slots where mask [T,
// end] is true, or (no mask) slots [0, end - T + t]; scores scaled by `scale`. Returns [T, H*hd].
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t end,
                     const std::optional<at::Tensor>& mask, double scale);

}  // namespace casspec
