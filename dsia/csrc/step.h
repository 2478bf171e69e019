// The decoder layers of a forward in one parallel region (step.cpp): for a float32 call whose every product is
// casspec's own (GGUF blocks as stored, or dense float32 weights), or a bfloat16 one whose every product is dense
// bfloat16 without a bias, norms, RoPE and attention casspec's too. The Stack (layers.cpp) runs its layers here
// where it can, the ATen loop otherwise; both give the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace casspec {

// a Stack slot's kind (PRODUCT_KINDS in dsia/fastloop.py)
constexpr int64_t kNone = -1;  // no product here (k, v of a fused q|k|v; up of a fused gate|up)
constexpr int64_t kPacked = 0;  // packed 4-bit kernel (Int4Linear, Int8GroupLinear)
constexpr int64_t kDense = 1;  // dense weight, through the call's dense kernel
constexpr int64_t kBlocks = 2;  // GGUF-style blocks as stored (dsia/blockq.py BlockLinear: codes, scales, outputs)
constexpr int64_t kSlots = 7;  // per layer: q (or q|k|v), k, v, o, gate (or gate|up), up, down

// one product of a layer: GGUF blocks or a dense float32 weight, writing outputs [offset, offset + N) of its
// group's buffer (q, k, v into q|k|v's; gate, up into gate|up's)
struct StepProduct {
  bool blocks;  // raw::Blocks, else dense
  raw::Blocks w;  // blocks
  const float* dense;  // panels [ceil(N / 64), K, 64] (dense_pack), float32
  const uint16_t* dense16;  // or bfloat16's (their bits)
  int64_t N, K, offset;
  // outputs a thread's share is counted in: a block tile, or half a dense group (two threads then share an odd
  // number of groups evenly)
  int64_t unit() const { return blocks ? 16 : kDenseGroup / 2; }
  int64_t units() const { return (N + unit() - 1) / unit(); }
};

// a bias added to outputs [offset, offset + n) of a group's buffer after its product (as the ATen loop adds it)
struct StepBias {
  const float* values;  // [n]
  int64_t offset, n;
};

// products that read one input and write one buffer (its row width: `width`)
struct StepGroup {
  std::vector<StepProduct> products;
  std::vector<StepBias> biases;
  int64_t width = 0;
  bool quantized = false;  // some product reads the input's 8-bit blocks
  int64_t units() const;
};

// one sequence's share of a call: rows [row0, row0 + rows) of x, attending with its own K/V caches [L, Hkv, S, hd]
// (contiguous), written at slots [start, start + rows) and read over [0, end) as mask [rows, end] says (none:
// causal by slot, row t at slot end - rows + t); a batched call has one per sequence, in row order
struct StepPart {
  at::Tensor k, v;
  int64_t row0, rows, start, end;
  std::optional<at::Tensor> mask;
};

struct StepLayer {
  const float* attn_norm;  // [D]
  const float* mlp_norm;  // [D]
  StepGroup qkv, o, gate_up, down;
};

// A Stack's layers as the one-region loop takes them (OwnStep::from: nullptr where some product is neither)
class OwnStep {
 public:
  // the Stack's slots (layers.cpp: kinds, weights, aux, panels, biases, outputs, block formats), norms [2L], heads;
  // nullptr where a slot is a kind this loop does not run, or a weight is not GGUF blocks / dense with its panels in
  // the norms' dtype (float32; bfloat16: dense only, no bias)
  static std::unique_ptr<OwnStep> from(const std::vector<at::Tensor>& norms, const std::vector<int64_t>& kinds,
                                       const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& aux,
                                       const std::vector<at::Tensor>& panels, const std::vector<at::Tensor>& biases,
                                       const std::vector<int64_t>& outputs, const std::vector<int64_t>& formats,
                                       int64_t n_heads, int64_t n_kv_heads, double eps);
  bool dense() const { return dense_; }  // whether some product is dense (the call's dense kernel must be casspec's)
  at::ScalarType dtype() const { return bf16_ ? at::kBFloat16 : at::kFloat; }  // of the calls it runs
  // x [T, D] after the embedding; parts (StepPart, caches in dtype()) covering its rows in order; cos, sin [T, hd];
  // all in dtype(). -> (x, delta) as Stack::run.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x, const std::vector<StepPart>& parts,
                                         const at::Tensor& cos, const at::Tensor& sin) const;

 private:
  std::vector<StepLayer> layers_;
  int64_t H_ = 0, Hkv_ = 0, hd_ = 0, D_ = 0, I_ = 0, widest_ = 0;  // heads, head size, model and MLP width, widest K
  double eps_ = 0;
  bool dense_ = false;
  bool bf16_ = false;  // bfloat16 calls: the activations' values bfloat16's (held as float32), each op's rounded
  std::vector<at::Tensor> norms_;  // the norms' weights as float32 (a bfloat16 one widened)
};

}  // namespace casspec
