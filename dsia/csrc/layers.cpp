// The decoder layers of a forward whose every product is a packed 4-bit kernel (the int4 draft levels, a GGUF
// target run as stored), as one call: the same ATen operations, in the same order, as Transformer._layers runs
// from Python (so the same bits), without Python between them. Registered as torch.ops.casspec.int4_layers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

// RMSNorm over the last dim, as dsia/model.py's rms_norm: torch's own op in float32, HF's rounding otherwise.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) {
    return at::rms_norm(x, {x.size(-1)}, weight, eps);
  }
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * xf.to(x.scalar_type());
}

// One packed product, as Int4Linear / Int8GroupLinear.__call__: x [T, in] -> [T, out] in x's dtype. `doubled`:
// the kernel takes [x, x] (8-bit codes stored as two 4-bit planes).
at::Tensor product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group_size,
                   bool doubled, at::ScalarType act) {
  at::Tensor a = x.to(act);
  if (doubled) {
    a = a.repeat({1, 2});
  }
  return at::_weight_int4pack_mm_for_cpu(a, packed, group_size, scales).to(x.scalar_type());
}

}  // namespace

// x [T, D]: the residual stream after the embedding. Per layer i: norms[2i], norms[2i + 1] (attention, MLP);
// products 4i..4i+3 (q|k|v, o, gate|up, down): packed[j], scales[j], group_sizes[j], doubled[j]. k_all, v_all
// [L, Hkv, S, hd]: the cache, written at slots [start, start + T), read over [0, end). cos, sin [T, hd] (sin
// signed, see Transformer.sin). mask [T, end] bool or none (is_causal: causal prefill). Returns (x, delta): the
// residual stream and the last sublayer's output, not yet added (the caller's final norm adds them).
std::tuple<at::Tensor, at::Tensor> int4_layers(
    at::Tensor x, std::vector<at::Tensor> norms, std::vector<at::Tensor> packed, std::vector<at::Tensor> scales,
    std::vector<int64_t> group_sizes, std::vector<int64_t> doubled, int64_t act_dtype, at::Tensor k_all,
    at::Tensor v_all, at::Tensor cos, at::Tensor sin, int64_t start, int64_t end,
    const std::optional<at::Tensor>& mask, bool is_causal, int64_t n_heads, int64_t n_kv_heads, double eps) {
  const int64_t n_layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == 4 * n_layers && scales.size() == packed.size() &&
                  group_sizes.size() == packed.size() && doubled.size() == packed.size(),
              "int4_layers: 4 products and 2 norms per layer");
  const at::ScalarType act = static_cast<at::ScalarType>(act_dtype);
  const int64_t T = x.size(0);
  const int64_t hd = k_all.size(3);
  const int64_t half = hd / 2;
  const bool gqa = n_heads != n_kv_heads;
  auto run = [&](const at::Tensor& in, int64_t j) {
    return product(in, packed[j], scales[j], group_sizes[j], doubled[j] != 0, act);
  };
  at::Tensor delta;  // the last sublayer's output, added to x together with the next norm
  for (int64_t i = 0; i < n_layers; ++i) {
    // attention
    at::Tensor h;
    if (delta.defined()) {
      x = x + delta;
    }
    h = rms_norm(x, norms[2 * i], eps);
    auto parts = run(h, 4 * i).split_with_sizes({(n_heads + n_kv_heads) * hd, n_kv_heads * hd}, -1);
    at::Tensor qk = parts[0].reshape({T, n_heads + n_kv_heads, hd}).transpose(0, 1);  // [H + Hkv, T, hd]
    at::Tensor v = parts[1].reshape({T, n_kv_heads, hd}).transpose(0, 1);  // [Hkv, T, hd]
    qk = qk * cos + at::roll(qk, {half}, {-1}) * sin;  // RoPE (dsia/model.py rope)
    auto qk_parts = qk.split_with_sizes({n_heads, n_kv_heads});
    at::Tensor k_layer = k_all.select(0, i);  // [Hkv, S, hd]
    at::Tensor v_layer = v_all.select(0, i);
    k_layer.slice(1, start, start + T).copy_(qk_parts[1]);
    v_layer.slice(1, start, start + T).copy_(v);
    at::Tensor o = at::scaled_dot_product_attention(
        qk_parts[0].unsqueeze(0), k_layer.slice(1, 0, end).unsqueeze(0), v_layer.slice(1, 0, end).unsqueeze(0),
        mask, 0.0, is_causal, std::nullopt, gqa)[0];  // [H, T, hd]
    delta = run(o.transpose(0, 1).reshape({T, n_heads * hd}), 4 * i + 1);
    // MLP
    x = x + delta;
    h = rms_norm(x, norms[2 * i + 1], eps);
    auto gate_up = run(h, 4 * i + 2).chunk(2, -1);
    delta = run(at::silu(gate_up[0]) * gate_up[1], 4 * i + 3);
  }
  return {x, delta};
}

TORCH_LIBRARY(casspec, m) {
  m.def("int4_layers", &int4_layers);
}
