// The decoder layers of one forward as one call: the same ATen operations, in the same order, as
// Transformer._layers runs them from Python (so the same bits), without Python between them. A Stack holds one
// plan's weights, laid out once (dsia/fastloop.py builds it); torch.classes.casspec.Stack.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"
#include "step.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

using casspec::kBlocks;
using casspec::kDense;
using casspec::kNone;
using casspec::kPacked;
using casspec::kSlots;

namespace {

// dense kernels (DENSE_KERNELS in fastloop.py)
constexpr int64_t kBlas = 1;  // F.linear
constexpr int64_t kMkl = 2;  // MKL's packed sgemm (dsia/kernels.py PackedSgemm)
constexpr int64_t kOwn = 3;  // casspec's own float32 / bfloat16 product (dense.cpp)

// RMSNorm over the last dim, as dsia/model.py's rms_norm: torch's own op in float32, HF's rounding otherwise.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) {
    return at::rms_norm(x, {x.size(-1)}, weight, eps);
  }
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * xf.to(x.scalar_type());
}

// RoPE of x [heads, T, hd] with the signed sin table (dsia/model.py rope): x * cos + roll(x, hd / 2) * sin
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + at::roll(x, {x.size(-1) / 2}, {-1}) * sin;
}

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w,
                      const std::optional<at::Tensor>& b) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkl::_mkl_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const std::optional<at::Tensor>&, int64_t)>();
  at::Tensor xc = x.contiguous();
  return op.call(xc, packed, w, b, xc.size(0));
}

// The batch-invariant mode's constants (dsia/invariant.py: BLOCK, FP32_MIN_ROWS, TORCH_OWN_MACS), given by the caller
struct Invariance {
  int64_t block;  // key positions per attention block
  int64_t fp32_min_rows;  // fewest rows a float32 product runs over
  int64_t torch_own_macs;  // a bf16 product of at most this many multiply-adds runs torch's own kernels
};

// a [..., M, K] @ b [..., K, N] over min_rows rows at least (the first row repeated), as invariant_matmul
at::Tensor invariant_matmul(const at::Tensor& a, const at::Tensor& b, const Invariance& inv) {
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  const int64_t batch = M * K > 0 ? a.numel() / (M * K) : 0;
  const int64_t rows = a.scalar_type() == at::kFloat
                           ? inv.fp32_min_rows
                           : std::max<int64_t>(2, inv.torch_own_macs / std::max<int64_t>(1, batch * K * N) + 1);
  at::Tensor padded = a;
  if (M < rows) {
    std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
    shape[shape.size() - 2] = rows - M;
    padded = at::cat({a, a.narrow(-2, 0, 1).expand(shape)}, -2);
  }
  return at::matmul(padded, b).narrow(-2, 0, M);
}

// parts [Hkv, n, ...] summed over dim 1 pairwise (zeros appended up to a power of two), as sum_blocks
at::Tensor sum_blocks(at::Tensor parts) {
  const int64_t n = parts.size(1);
  int64_t width = 1;
  while (width < n) {
    width <<= 1;
  }
  if (width > n) {
    std::vector<int64_t> shape(parts.sizes().begin(), parts.sizes().end());
    shape[1] = width - n;
    parts = at::cat({parts, parts.new_zeros(shape)}, 1);
  }
  while (parts.size(1) > 1) {
    parts = parts.slice(1, 0, parts.size(1), 2) + parts.slice(1, 1, parts.size(1), 2);
  }
  return parts.select(1, 0);
}

// attention of q [H, T, hd] over a layer's keys, values [Hkv, slots, hd], each row over its own keys (RowKeys:
// shared, bias [T, shared + W], tail [T, W] or undefined, end), block by block, as block_attention: [H, T, hd]
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t shared,
                           const at::Tensor& bias, const std::optional<at::Tensor>& tail, int64_t end, double scale,
                           const Invariance& inv) {
  const int64_t H = q.size(0), T = q.size(1), hd = q.size(2);
  const int64_t Hkv = keys.size(0), G = H / Hkv, B = inv.block, nS = shared / B;
  const int64_t span = std::max(shared, end);
  at::Tensor k = keys.slice(1, 0, span).contiguous();  // [Hkv, span, hd]
  at::Tensor scores = invariant_matmul(q.reshape({Hkv, G * T, hd}), k.transpose(1, 2), inv).view({Hkv, G, T, span});
  at::Tensor v_t;
  int64_t W = 0;
  if (tail) {
    W = tail->size(1);
    at::Tensor gathered = scores.slice(-1, shared).gather(-1, tail->expand({Hkv, G, T, W}));  // [Hkv, G, T, W]
    scores = at::cat({scores.slice(-1, 0, shared), gathered}, -1);  // [Hkv, G, T, shared + W]
    v_t = values.index_select(1, tail->flatten() + shared).view({Hkv, T, W, hd});
  }
  scores = at::add(bias, scores, scale);  // float32, -inf past each row's keys
  at::Tensor p = at::softmax(scores, -1).to(q.scalar_type());  // [Hkv, G, T, positions]
  at::Tensor p_in = p.slice(-1, 0, shared).reshape({Hkv, G * T, nS, B}).transpose(1, 2);  // [Hkv, nS, G*T, B]
  at::Tensor v_in = values.slice(1, 0, shared).contiguous().view({Hkv, nS, B, hd});
  at::Tensor parts = invariant_matmul(p_in, v_in, inv).view({Hkv, nS, G, T, hd});
  if (tail) {
    const int64_t nW = W / B;
    at::Tensor p_t = p.slice(-1, shared).reshape({Hkv, G, T, nW, B}).permute({0, 2, 3, 1, 4});  // [Hkv, T, nW, G, B]
    at::Tensor parts_t = invariant_matmul(p_t, v_t.view({Hkv, T, nW, B, hd}), inv);  // [Hkv, T, nW, G, hd]
    parts = at::cat({parts, parts_t.permute({0, 2, 3, 1, 4})}, 1);  // [Hkv, nS + nW, G, T, hd]
  }
  return sum_blocks(parts.to(at::kFloat)).to(q.scalar_type()).reshape({H, T, hd});
}

}  // namespace

struct Stack : torch::CustomClassHolder {
  std::vector<at::Tensor> norms;  // [2L] attention, MLP norm weights
  std::vector<int64_t> kinds;  // [7L] each slot's kind
  std::vector<at::Tensor> weights;  // [7L] packed codes, or the dense weight
  std::vector<at::Tensor> aux;  // [7L] packed: scales and zeros (blocks: scales); dense: MKL's packed copy (or empty)
  std::vector<at::Tensor> panels;  // [7L] dense: casspec's panels of the weight (dense_pack), or empty
  std::vector<at::Tensor> biases;  // [7L] bias (or empty)
  std::vector<int64_t> group_sizes;  // [7L] packed: group size; blocks: the outputs
  std::vector<int64_t> doubled;  // [7L] packed: 1 where the kernel takes [x, x] (8-bit codes as two 4-bit planes);
                                 // blocks: the block format (its code, ops.h BlockFormat)
  int64_t act_dtype;  // ATen ScalarType code of the packed kernels' activations
  int64_t n_heads, n_kv_heads;
  double eps;
  Invariance inv;  // the batch-invariant attention's constants (a call with row keys uses them)
  std::unique_ptr<casspec::OwnStep> own_step;  // the layers in one parallel region, where every product is casspec's

  Stack(std::vector<at::Tensor> norms, std::vector<int64_t> kinds, std::vector<at::Tensor> weights,
        std::vector<at::Tensor> aux, std::vector<at::Tensor> panels, std::vector<at::Tensor> biases,
        std::vector<int64_t> group_sizes, std::vector<int64_t> doubled, int64_t act_dtype, int64_t n_heads,
        int64_t n_kv_heads, double eps, std::vector<int64_t> invariance)
      : norms(std::move(norms)), kinds(std::move(kinds)), weights(std::move(weights)), aux(std::move(aux)),
        panels(std::move(panels)), biases(std::move(biases)), group_sizes(std::move(group_sizes)),
        doubled(std::move(doubled)), act_dtype(act_dtype), n_heads(n_heads), n_kv_heads(n_kv_heads), eps(eps) {
    TORCH_CHECK(invariance.size() == 3, "casspec Stack: block, float32 min rows, torch's own MACs");
    for (int64_t kind : this->kinds) {
      TORCH_CHECK(kind == kNone || kind == kPacked || kind == kDense || kind == kBlocks,
                  "casspec Stack: unknown product kind ", kind);
    }
    inv = Invariance{invariance[0], invariance[1], invariance[2]};
    TORCH_CHECK(inv.block >= 1 && inv.fp32_min_rows >= 1 && inv.torch_own_macs >= 0,
                "casspec Stack: an attention block and float32 min rows of at least 1");
    TORCH_CHECK(n_heads >= 1 && n_kv_heads >= 1 && n_heads % n_kv_heads == 0, "casspec Stack: ", n_heads,
                " query heads over ", n_kv_heads, " KV heads (at least one each, a multiple of the KV heads)");
    TORCH_CHECK(std::isfinite(eps) && eps >= 0, "casspec Stack: eps must be finite and >= 0");
    TORCH_CHECK(act_dtype >= 0 && act_dtype < static_cast<int64_t>(at::ScalarType::NumOptions),
                "casspec Stack: unknown activation dtype ", act_dtype);
    TORCH_CHECK(this->norms.size() % 2 == 0, "casspec Stack: 2 norms per layer");
    const size_t slots = kSlots * (this->norms.size() / 2);
    TORCH_CHECK(this->kinds.size() == slots && this->weights.size() == slots && this->aux.size() == slots &&
                    this->panels.size() == slots &&
                    this->biases.size() == slots && this->group_sizes.size() == slots &&
                    this->doubled.size() == slots,
                "casspec Stack: 7 product slots and 2 norms per layer");
    for (size_t s = 0; s < slots; s += kSlots) {  // q (or q|k|v), o, gate (or gate|up) and down are products;
      const auto& k = this->kinds;                 // k and v are both fused into q or neither, up into gate or not
      TORCH_CHECK(k[s] != kNone && k[s + 3] != kNone && k[s + 4] != kNone && k[s + 6] != kNone &&
                      (k[s + 1] == kNone) == (k[s + 2] == kNone),
                  "casspec Stack: layer ", s / kSlots, "'s slots do not form its products");
      for (size_t j = s; j < s + kSlots; ++j) {
        TORCH_CHECK(k[j] == kNone || this->weights[j].defined(), "casspec Stack: slot ", j, " has no weight");
      }
    }
    own_step = casspec::OwnStep::from(this->norms, this->kinds, this->weights, this->aux, this->panels,
                                      this->biases, this->group_sizes, this->doubled, n_heads, n_kv_heads, eps);
  }

  // whether a call with casspec's ops and attention (and its own dense kernel) in the Stack's dtype runs in one
  // parallel region
  bool one_region() const { return own_step != nullptr; }

  // slot j's product of x [T, in] -> [T, out] in x's dtype, as Transformer._linear / _fused run it (a fused
  // product's slots hold its parts' biases, added after the split: `biased` false)
  at::Tensor product(const at::Tensor& x, int64_t j, int64_t dense_kernel, bool biased = true) const {
    const std::optional<at::Tensor> b = biased ? maybe(biases[j]) : std::nullopt;
    if (kinds[j] == kPacked) {  // Int4Linear / Int8GroupLinear.__call__, then the bias
      at::Tensor a = x.to(static_cast<at::ScalarType>(act_dtype));
      if (doubled[j] != 0) {
        a = a.repeat({1, 2});
      }
      at::Tensor y = at::_weight_int4pack_mm_for_cpu(a, weights[j], group_sizes[j], aux[j]).to(x.scalar_type());
      return b ? y + *b : y;
    }
    if (kinds[j] == kBlocks) {  // BlockLinear.__call__, then the bias
      at::Tensor y = casspec::block_linear(x.to(at::kFloat), weights[j], aux[j], group_sizes[j], doubled[j], -1)
                         .to(x.scalar_type());
      return b ? y + *b : y;
    }
    if (dense_kernel == kMkl) {
      return mkl_linear(x, aux[j], weights[j], b);
    }
    if (dense_kernel == kOwn && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
        weights[j].scalar_type() == x.scalar_type()) {  // (casspec's own: float32 or bfloat16)
      return panels[j].numel() > 0 ? casspec::dense_panels(x, panels[j], weights[j].size(0), b, -1)
                                   : casspec::dense_linear(x, weights[j], b, -1);
    }
    return at::linear(x, weights[j], b);
  }

  // x [T, D]: the residual stream after the embedding. k_all, v_all [L, Hkv, S, hd]: the cache, written at slots
  // [start, start + T), read over [0, end). cos, sin [T, hd] (sin signed: Transformer.sin). mask [T, end] bool or
  // none (is_causal: causal prefill). dense_kernel: kBlas or kMkl for this call's dense products. rows_bias
  // given: the batch-invariant attention over each row's keys (RowKeys: rows_shared, rows_bias, rows_tail,
  // rows_end) instead of SDPA. ops: a call's norms and RoPE by casspec's own ops (ops.cpp), as the model's
  // Pointwise runs them in the Python loop; own_attention: its attention too (casspec::attention over `mask`, in
  // place of SDPA and of the rows' attention). Returns (x, delta): the residual stream and the last sublayer's
  // output, not yet added (the caller's final norm adds them).
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, int64_t dense_kernel, at::Tensor k_all, at::Tensor v_all,
                                         at::Tensor cos, at::Tensor sin, int64_t start, int64_t end,
                                         std::optional<at::Tensor> mask, bool is_causal,
                                         std::optional<at::Tensor> rows_bias, std::optional<at::Tensor> rows_tail,
                                         int64_t rows_shared, int64_t rows_end, bool ops, bool own_attention) const {
    TORCH_CHECK(x.dim() == 2, "casspec Stack: x [T, D] expected");
    return layers(x, dense_kernel, {casspec::StepPart{k_all, v_all, 0, x.size(0), start, end, mask}}, cos, sin,
                  is_causal, rows_bias, rows_tail, rows_shared, rows_end, ops, own_attention);
  }

  // Several sequences' rows in one call (continuous batching): x [T, D] their rows in order, each sequence's
  // rows[j] rows attending with its own caches ks[j], vs[j] [L, Hkv, S_j, hd], written at slots [starts[j],
  // starts[j] + rows[j]) and read over [0, ends[j]) as masks[j] [rows[j], ends[j]] (or none: causal by slot) say,
  // by casspec's ops and attention (each row's bits those of the same row in a call of its sequence alone, as
  // run(..., ops, own_attention) computes it). cos, sin [T, hd].
  std::tuple<at::Tensor, at::Tensor> run_batch(at::Tensor x, int64_t dense_kernel, std::vector<at::Tensor> ks,
                                               std::vector<at::Tensor> vs, at::Tensor cos, at::Tensor sin,
                                               std::vector<int64_t> rows, std::vector<int64_t> starts,
                                               std::vector<int64_t> ends,
                                               std::vector<std::optional<at::Tensor>> masks) const {
    const size_t n = ks.size();
    TORCH_CHECK(n >= 1 && vs.size() == n && rows.size() == n && starts.size() == n && ends.size() == n &&
                    masks.size() == n,
                "casspec Stack: a batch of at least one sequence, with caches, rows, starts, ends and masks each");
    std::vector<casspec::StepPart> parts;
    int64_t row0 = 0;
    for (size_t j = 0; j < n; ++j) {
      TORCH_CHECK(rows[j] >= 1, "casspec Stack: a sequence of the batch has ", rows[j], " rows");
      parts.push_back(casspec::StepPart{ks[j], vs[j], row0, rows[j], starts[j], ends[j], masks[j]});
      row0 += rows[j];
    }
    return layers(x, dense_kernel, parts, cos, sin, false, std::nullopt, std::nullopt, 0, 0, true, true);
  }

 private:
  std::tuple<at::Tensor, at::Tensor> layers(at::Tensor x, int64_t dense_kernel,
                                            const std::vector<casspec::StepPart>& parts, at::Tensor cos,
                                            at::Tensor sin, bool is_causal, std::optional<at::Tensor> rows_bias,
                                            std::optional<at::Tensor> rows_tail, int64_t rows_shared,
                                            int64_t rows_end, bool ops, bool own_attention) const {
    TORCH_CHECK(dense_kernel == kBlas || dense_kernel == kMkl || dense_kernel == kOwn,
                "casspec Stack: dense kernel 1 (blas), 2 (mkl) or 3 (casspec)");
    const int64_t n_layers = static_cast<int64_t>(norms.size()) / 2;
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_floating_point(),
                "casspec Stack: x [T, D] floating point on the CPU expected");
    const int64_t T = x.size(0);
    TORCH_CHECK(parts.size() == 1 || own_attention, "casspec Stack: a batch of sequences attends by its own op");
    int64_t covered = 0, hd = 0;
    for (const casspec::StepPart& p : parts) {
      const at::Tensor &k_all = p.k, &v_all = p.v;
      TORCH_CHECK(k_all.dim() == 4 && v_all.sizes() == k_all.sizes() && k_all.size(0) >= n_layers &&
                      k_all.size(1) == n_kv_heads && k_all.device().is_cpu() && v_all.device().is_cpu() &&
                      k_all.scalar_type() == x.scalar_type() && v_all.scalar_type() == x.scalar_type() &&
                      (hd == 0 || k_all.size(3) == hd),
                  "casspec Stack: K and V caches [", n_layers, ", ", n_kv_heads, ", S, hd] of x's dtype expected, got ",
                  k_all.sizes(), " and ", v_all.sizes());
      hd = k_all.size(3);
      const int64_t S = k_all.size(2);
      TORCH_CHECK(p.row0 == covered && p.rows >= 1 && p.start >= 0 && p.start <= S - p.rows &&
                      p.end >= p.start + p.rows && p.end <= S,
                  "casspec Stack: slots [", p.start, ", ", p.start + p.rows, ") written and [0, ", p.end,
                  ") read must lie within the cache's ", S);
      TORCH_CHECK(!p.mask || (p.mask->dim() == 2 && p.mask->size(0) == p.rows && p.mask->size(1) == p.end),
                  "casspec Stack: mask [", p.rows, ", ", p.end, "] expected");
      covered += p.rows;
    }
    TORCH_CHECK(covered == T, "casspec Stack: the sequences' rows (", covered, ") are not x's ", T);
    TORCH_CHECK(hd >= 2 && hd % 2 == 0, "casspec Stack: an even head size expected, got ", hd);
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == hd && sin.sizes() == cos.sizes(),
                "casspec Stack: cos and sin [", T, ", ", hd, "] expected, got ", cos.sizes(), " and ", sin.sizes());
    const bool gqa = n_heads != n_kv_heads;
    // casspec's ops run this call's norms and RoPE (float32 or bfloat16)
    const bool own = ops && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
    TORCH_CHECK(!own_attention || x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "casspec Stack: its own attention takes float32 or bfloat16");
    // (x + delta, its norm) as the Python loop's Pointwise.add_rms_norm, or the first layer's norm of x
    auto residual_norm = [&](const at::Tensor& delta, const at::Tensor& weight) -> std::tuple<at::Tensor, at::Tensor> {
      if (own) {
        if (delta.defined()) {
          return casspec::add_rms_norm(x, delta, weight, eps);
        }
        return {x, casspec::rms_norm(x, weight, eps)};
      }
      at::Tensor sum = delta.defined() ? x + delta : x;
      return {sum, rms_norm(sum, weight, eps)};
    };
    auto rotate = [&](const at::Tensor& t, const at::Tensor& c, const at::Tensor& s) {
      return own ? casspec::rope(t, c, s) : rope(t, c, s);
    };
    const bool contiguous = std::all_of(parts.begin(), parts.end(), [](const casspec::StepPart& p) {
      return p.k.is_contiguous() && p.v.is_contiguous();
    });
    if (own_step && own && own_attention && !rows_bias && (!own_step->dense() || dense_kernel == kOwn) &&
        x.scalar_type() == own_step->dtype() && contiguous) {
      return own_step->run(x, parts, cos, sin);  // (the same bits in one parallel region)
    }
    TORCH_CHECK(own || parts.size() == 1, "casspec Stack: a batch of sequences runs casspec's ops");
    at::Tensor delta;  // the last sublayer's output, added to x together with the next norm
    for (int64_t i = 0; i < n_layers; ++i) {
      const int64_t s = kSlots * i;
      // attention: q, k, v [heads, T, hd], RoPE (dsia/model.py rope), K/V written, attended, projected
      at::Tensor h;
      std::tie(x, h) = residual_norm(delta, norms[2 * i]);
      at::Tensor q, k, v;
      const bool fused = kinds[s + 1] == kNone;
      const bool biased = biases[s].numel() > 0 || biases[s + 1].numel() > 0 || biases[s + 2].numel() > 0;
      if (fused && !biased) {  // one q|k|v product, one RoPE call for q and k
        auto parts = product(h, s, dense_kernel).split_with_sizes({(n_heads + n_kv_heads) * hd, n_kv_heads * hd}, -1);
        at::Tensor qk = parts[0].reshape({T, n_heads + n_kv_heads, hd}).transpose(0, 1);  // [H + Hkv, T, hd]
        v = parts[1].reshape({T, n_kv_heads, hd}).transpose(0, 1);  // [Hkv, T, hd]
        qk = rotate(qk, cos, sin);
        auto qk_parts = qk.split_with_sizes({n_heads, n_kv_heads});
        q = qk_parts[0];
        k = qk_parts[1];
      } else {
        if (fused) {  // one q|k|v product, split, each part's bias added
          auto parts = product(h, s, dense_kernel, false)
                           .split_with_sizes({n_heads * hd, n_kv_heads * hd, n_kv_heads * hd}, -1);
          q = parts[0];
          k = parts[1];
          v = parts[2];
          for (int64_t p = 0; p < 3; ++p) {
            at::Tensor& t = p == 0 ? q : p == 1 ? k : v;
            if (biases[s + p].numel() > 0) {
              t = t + biases[s + p];
            }
          }
        } else {
          q = product(h, s, dense_kernel);
          k = product(h, s + 1, dense_kernel);
          v = product(h, s + 2, dense_kernel);
        }
        q = q.reshape({T, n_heads, hd}).transpose(0, 1);  // [H, T, hd]
        k = k.reshape({T, n_kv_heads, hd}).transpose(0, 1);  // [Hkv, T, hd]
        v = v.reshape({T, n_kv_heads, hd}).transpose(0, 1);
        q = rotate(q, cos, sin);
        k = rotate(k, cos, sin);
      }
      const double scale = std::pow(static_cast<double>(hd), -0.5);
      at::Tensor o;  // [T, H*hd]
      std::vector<at::Tensor> outs;  // each sequence's rows of o (own attention)
      for (const casspec::StepPart& p : parts) {
        at::Tensor k_layer = p.k.select(0, i);  // [Hkv, S, hd]
        at::Tensor v_layer = p.v.select(0, i);
        k_layer.slice(1, p.start, p.start + p.rows).copy_(k.slice(1, p.row0, p.row0 + p.rows));
        v_layer.slice(1, p.start, p.start + p.rows).copy_(v.slice(1, p.row0, p.row0 + p.rows));
        if (own_attention) {
          outs.push_back(casspec::attention(q.slice(1, p.row0, p.row0 + p.rows), k_layer, v_layer, p.end, p.mask,
                                            scale));
          continue;
        }
        o = rows_bias ? block_attention(q, k_layer, v_layer, rows_shared, *rows_bias, rows_tail, rows_end, scale, inv)
                      : at::scaled_dot_product_attention(
                            q.unsqueeze(0), k_layer.slice(1, 0, p.end).unsqueeze(0),
                            v_layer.slice(1, 0, p.end).unsqueeze(0), p.mask, 0.0, is_causal, std::nullopt,
                            gqa)[0];  // [H, T, hd]
        o = o.transpose(0, 1).reshape({T, n_heads * hd});
      }
      if (own_attention) {
        o = outs.size() == 1 ? outs[0] : at::cat(outs, 0);
      }
      delta = product(o, s + 3, dense_kernel);
      // MLP
      std::tie(x, h) = residual_norm(delta, norms[2 * i + 1]);
      at::Tensor gate, up;
      if (kinds[s + 5] == kNone) {  // one gate|up product
        auto parts = product(h, s + 4, dense_kernel, false).chunk(2, -1);
        gate = parts[0];
        up = parts[1];
      } else {
        gate = product(h, s + 4, dense_kernel);
        up = product(h, s + 5, dense_kernel);
      }
      delta = product(own ? casspec::silu_mul(gate, up) : at::silu(gate) * up, s + 6, dense_kernel);
    }
    return {x, delta};
  }
};

// every op and class of the library, registered here (one TORCH_LIBRARY: the other files hold no torch/library.h,
// whose parse was a third of the library's 20-second build)
TORCH_LIBRARY(casspec, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &casspec::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)", &casspec::add_rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &casspec::rope);
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor", &casspec::silu_mul);
  m.def("attention(Tensor q, Tensor keys, Tensor values, int end, Tensor? mask, float scale) -> Tensor",
        &casspec::attention);
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, int n, int format, int isa=-1) -> Tensor", &casspec::block_linear);
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias=None, int isa=-1) -> Tensor", &casspec::dense_linear);
  m.def("dense_pack(Tensor w) -> Tensor", &casspec::dense_pack);
  m.def("machine_isa() -> int", &casspec::machine_isa_op);
  m.def("gumbel(int seed, int position, Tensor? tokens, int vocab) -> Tensor", &casspec::gumbel);
  m.def("row_top(Tensor x, int k) -> (Tensor, Tensor)", &casspec::row_top);
  m.def("row_top_lse(Tensor x, int k, float scale) -> (Tensor, Tensor, Tensor)", &casspec::row_top_lse);
  m.def("coupled_top(Tensor logits, float temperature, int top_k, float top_p, int seed, Tensor positions, int k, "
        "int candidates) -> (Tensor, Tensor, Tensor)", &casspec::coupled_top);
  m.def("dense_panels(Tensor x, Tensor panels, int N, Tensor? bias=None, int isa=-1) -> Tensor",
        &casspec::dense_panels);
  m.class_<Stack>("Stack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, int64_t, double,
                       std::vector<int64_t>>())
      .def("run", &Stack::run)
      .def("run_batch", &Stack::run_batch)
      .def("one_region", &Stack::one_region);
}
