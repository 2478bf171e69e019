// A float32 or bfloat16 forward's decoder layers in one parallel region, on casspec's own kernels only (step.h).
// Called layer by layer from ATen, a one-token step is some 600 small operations, each allocating its output and each
// product waking the other threads and waiting for them: on a 2-core machine about a third of a native step. Here the
// machine's threads enter once; each takes its share of every phase of a layer (the rows of a norm, the tiles of a
// product, the heads of RoPE and of the attention), and they meet at a barrier between phases. Each output is
// computed by the same function of the same operands as in the ATen loop (Stack::run), so the same bits, however
// the work is split between threads; the 8-bit activations of a block product are made by the phase that writes
// its input, block by block, as block_linear makes them. A bfloat16 call keeps its activations as float32 buffers of
// bfloat16 values: each op's result rounded where the op (and the ATen loop's bfloat16 tensors) rounds it.
#include "step.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace casspec {
namespace {

// [a, b): thread `tid` of `n`'s share of `count` items
inline std::pair<int64_t, int64_t> share(int64_t count, int64_t tid, int64_t n) {
  return {count * tid / n, count * (tid + 1) / n};
}

}  // namespace

int64_t StepGroup::units() const {
  int64_t total = 0;
  for (const StepProduct& p : products) {
    total += p.units();
  }
  return total;
}

namespace {

const char* kWhat = "casspec Stack (one-region step)";
constexpr int64_t kQuantizeRun = 48;  // silu's items (blocks of 32) quantized in one call (a SmolLM2 row's 1536)

// slot j as a product of `offset` in its group's buffer with `in` inputs, or nullopt where it is neither GGUF
// blocks (codes, scales as block_linear reads them; float32 calls) nor a dense weight [N, in] in `dtype`
std::optional<StepProduct> product_of(int64_t kind, const at::Tensor& w, const at::Tensor& scales,
                                      const at::Tensor& panels, int64_t outputs, int64_t format, int64_t in,
                                      int64_t offset, at::ScalarType dtype) {
  StepProduct p{};
  p.K = in;
  p.offset = offset;
  if (kind == kBlocks && dtype == at::kFloat) {
    const raw::BlockFormat f = raw::block_format(format);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == f.record(),
                kWhat, ": block codes [tiles, blocks, ", f.record(), "] contiguous expected, got ", w.sizes());
    const int64_t tiles = w.size(0), blocks = w.size(1), supers = blocks / f.super;
    TORCH_CHECK(blocks % f.super == 0 && scales.scalar_type() == at::kHalf && scales.dim() == 4 &&
                    scales.is_contiguous() && scales.size(0) == (f.mins != 0 ? 2 : 1) && scales.size(1) == tiles &&
                    scales.size(2) == supers && scales.size(3) == 16,
                kWhat, ": block scales [", f.mins != 0 ? 2 : 1, ", ", tiles, ", ", supers, ", 16] float16 expected, got ",
                scales.sizes());
    TORCH_CHECK(outputs >= 1 && outputs <= 16 * tiles && outputs > 16 * (tiles - 1) && blocks * 32 == in, kWhat,
                ": blocks of ", outputs, " outputs over ", tiles, " tiles and ", blocks * 32, " inputs where the layer "
                "has ", in);
    const uint16_t* d = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    p.blocks = true;
    p.w = raw::Blocks{w.data_ptr<uint8_t>(), f, d, f.mins != 0 ? d + tiles * supers * 16 : nullptr, outputs, in};
    p.N = outputs;
    return p;
  }
  if (kind == kDense && w.scalar_type() == dtype && w.dim() == 2 && panels.numel() > 0) {
    TORCH_CHECK(w.size(1) == in, kWhat, ": a dense weight of ", w.size(1), " inputs where the layer has ", in);
    check_panels(panels, w.size(0), in, dtype, "Stack (one-region step): a dense weight's panels");
    if (dtype == at::kFloat) {
      p.dense = panels.data_ptr<float>();
    } else {
      p.dense16 = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
    }
    p.N = w.size(0);
    return p;
  }
  return std::nullopt;
}

// a float32 vector of n values on the CPU (a bias or a norm's weight), or a Stack error
const float* vector_of(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n && t.is_contiguous() &&
                  t.device().is_cpu(),
              kWhat, ": ", what, " of ", n, " float32 values expected, got ", t.sizes());
  return t.data_ptr<float>();
}

}  // namespace

std::unique_ptr<OwnStep> OwnStep::from(const std::vector<at::Tensor>& norms, const std::vector<int64_t>& kinds,
                                       const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& aux,
                                       const std::vector<at::Tensor>& panels, const std::vector<at::Tensor>& biases,
                                       const std::vector<int64_t>& outputs, const std::vector<int64_t>& formats,
                                       int64_t n_heads, int64_t n_kv_heads,
                                       double eps) {
  auto step = std::unique_ptr<OwnStep>(new OwnStep());
  const int64_t L = static_cast<int64_t>(norms.size()) / 2;
  if (L == 0 || norms[0].dim() != 1 ||
      (norms[0].scalar_type() != at::kFloat && norms[0].scalar_type() != at::kBFloat16)) {
    return nullptr;
  }
  const at::ScalarType dtype = norms[0].scalar_type();
  step->bf16_ = dtype == at::kBFloat16;
  for (const at::Tensor& bias : biases) {
    if (step->bf16_ && bias.numel() > 0) {  // (the ATen loop rounds a bfloat16 product before its bias)
      return nullptr;
    }
  }
  for (const at::Tensor& norm : norms) {
    TORCH_CHECK(norm.scalar_type() == dtype && norm.device().is_cpu(), kWhat, ": every norm's weight in ",
                c10::toString(dtype), " on the CPU expected");
    step->norms_.push_back(norm.to(at::kFloat).contiguous());  // (widened: exact)
  }
  step->H_ = n_heads;
  step->Hkv_ = n_kv_heads;
  step->eps_ = eps;
  step->D_ = norms[0].size(0);
  const int64_t D = step->D_;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t s = kSlots * i;
    StepLayer layer{vector_of(step->norms_[2 * i], D, "an attention norm"),
                    vector_of(step->norms_[2 * i + 1], D, "an MLP norm"), {}, {}, {}, {}};
    // a group of slots [first, last] reading `in` inputs (a fused product: the first slot alone, its parts' biases
    // at their parts' offsets, `parts` their widths); false where a slot is a kind this loop does not run
    auto group = [&](StepGroup& g, int64_t first, int64_t count, int64_t in, std::vector<int64_t> parts) -> bool {
      const bool fused = count > 1 && kinds[first + 1] == kNone;
      int64_t offset = 0;
      for (int64_t j = first; j < first + (fused ? 1 : count); ++j) {
        std::optional<StepProduct> p =
            product_of(kinds[j], weights[j], aux[j], panels[j], outputs[j], formats[j], in, offset, dtype);
        if (!p) {
          return false;
        }
        g.products.push_back(*p);
        offset += p->N;
      }
      g.width = offset;
      int64_t at = 0;
      for (int64_t j = first; j < first + count; ++j) {  // (fused: part j's bias at its part's offset)
        const int64_t n = fused ? parts[j - first] : g.products[j - first].N;
        TORCH_CHECK(!fused || j == first || kinds[j] == kNone, kWhat, ": slot ", j, " is part of a fused product");
        if (biases[j].numel() > 0) {
          g.biases.push_back(StepBias{vector_of(biases[j], n, "a bias"), at, n});
        }
        at += n;
      }
      TORCH_CHECK(at == g.width, kWhat, ": a fused product of ", g.width, " outputs where its parts have ", at);
      for (const StepProduct& p : g.products) {
        g.quantized = g.quantized || p.blocks;
        step->dense_ = step->dense_ || !p.blocks;
      }
      step->widest_ = std::max(step->widest_, in);
      return true;
    };
    auto width = [&](int64_t j) {  // slot j's outputs (GGUF blocks: as the Stack was given them; dense: its rows)
      return kinds[j] == kBlocks ? outputs[j] : weights[j].dim() == 2 ? weights[j].size(0) : 0;
    };
    const bool fused_qkv = kinds[s + 1] == kNone, fused_mlp = kinds[s + 5] == kNone;
    const int64_t heads = n_heads + 2 * n_kv_heads;
    const int64_t total = fused_qkv ? width(s) : width(s) + width(s + 1) + width(s + 2);
    const int64_t hd = total / heads;
    if (i == 0) {
      step->hd_ = hd;
    }
    TORCH_CHECK(total == heads * hd && hd == step->hd_ && hd >= 2 && hd % 2 == 0 && hd <= kMaxHeadDim, kWhat,
                ": layer ", i, "'s q|k|v of ", total, " outputs is no even head size up to ", kMaxHeadDim, " for ",
                n_heads, " + 2 x ", n_kv_heads, " heads");
    const int64_t I = fused_mlp ? width(s + 4) / 2 : width(s + 4);
    if (!group(layer.qkv, s, 3, D, {n_heads * hd, n_kv_heads * hd, n_kv_heads * hd}) ||
        !group(layer.o, s + 3, 1, n_heads * hd, {D}) || !group(layer.gate_up, s + 4, 2, D, {I, I})) {
      return nullptr;
    }
    if (i == 0) {
      step->I_ = I;
    }
    TORCH_CHECK(layer.gate_up.width == 2 * I && I == step->I_ && layer.o.width == D, kWhat, ": layer ", i,
                "'s products do not form a layer of width ", D);
    if (!group(layer.down, s + 6, 1, I, {D})) {
      return nullptr;
    }
    TORCH_CHECK(layer.down.width == D, kWhat, ": layer ", i, "'s down product has ", layer.down.width, " outputs, not ",
                D);
    step->layers_.push_back(std::move(layer));
  }
  return step;
}

std::tuple<at::Tensor, at::Tensor> OwnStep::run(const at::Tensor& x_in, const std::vector<StepPart>& parts,
                                                const at::Tensor& cos, const at::Tensor& sin) const {
  const int64_t T = x_in.size(0), D = D_, H = H_, Hkv = Hkv_, hd = hd_, I = I_, G = H / Hkv;
  const int64_t L = static_cast<int64_t>(layers_.size()), HD = H * hd;
  const at::ScalarType dtype = this->dtype();
  const bool bf16 = bf16_;
  TORCH_CHECK(x_in.scalar_type() == dtype && x_in.dim() == 2 && x_in.size(1) == D, kWhat, ": x [T, ", D, "] in ",
              c10::toString(dtype), " expected");
  // each part's caches (their layer 0 at k, v; S slots a head), mask, and the part of every row
  struct Part {
    float* k;
    float* v;
    uint16_t* k16;
    uint16_t* v16;
    int64_t S, row0, rows, start, end;
    at::Tensor mask;
    const bool* seen;
  };
  std::vector<Part> ps;
  std::vector<int64_t> part_of(T, -1);
  int64_t covered = 0;
  for (const StepPart& p : parts) {
    const at::Tensor &k_all = p.k, &v_all = p.v;
    TORCH_CHECK(k_all.scalar_type() == dtype && v_all.scalar_type() == dtype && k_all.is_contiguous() &&
                    v_all.is_contiguous() && k_all.dim() == 4 && k_all.sizes() == v_all.sizes() &&
                    k_all.size(0) >= L && k_all.size(1) == Hkv && k_all.size(3) == hd,
                kWhat, ": K and V caches [", L, ", ", Hkv, ", S, ", hd, "] in ", c10::toString(dtype),
                " contiguous expected");
    const int64_t S = k_all.size(2);
    TORCH_CHECK(p.row0 == covered && p.rows >= 1 && p.row0 + p.rows <= T && p.start >= 0 && p.start + p.rows <= S &&
                    p.end >= p.start + p.rows && p.end <= S,
                kWhat, ": a part of rows [", p.row0, ", ", p.row0 + p.rows, ") of ", T, " (parts in row order, ",
                "covering them) writing slots [", p.start, ", ", p.start + p.rows, ") and reading [0, ", p.end,
                ") of ", S);
    covered += p.rows;
    at::Tensor m = visible_mask(p.mask, p.rows, p.end, kWhat);
    Part q{bf16 ? nullptr : k_all.data_ptr<float>(), bf16 ? nullptr : v_all.data_ptr<float>(),
           bf16 ? reinterpret_cast<uint16_t*>(k_all.data_ptr<at::BFloat16>()) : nullptr,
           bf16 ? reinterpret_cast<uint16_t*>(v_all.data_ptr<at::BFloat16>()) : nullptr,
           S, p.row0, p.rows, p.start, p.end, m, m.defined() ? m.data_ptr<bool>() : nullptr};
    std::fill(part_of.begin() + p.row0, part_of.begin() + p.row0 + p.rows, static_cast<int64_t>(ps.size()));
    ps.push_back(std::move(q));
  }
  TORCH_CHECK(covered == T, kWhat, ": parts cover ", covered, " of the ", T, " rows");
  // the attention's items: a part's block of rows (and a query head each)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> row_blocks;  // (part, r0, r1) with rows absolute
  for (int64_t j = 0; j < static_cast<int64_t>(ps.size()); ++j) {
    for (int64_t r0 = ps[j].row0; r0 < ps[j].row0 + ps[j].rows; r0 += kRowBlock) {
      row_blocks.emplace_back(j, r0, std::min(ps[j].row0 + ps[j].rows, r0 + kRowBlock));
    }
  }
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();  // (widened: exact)
  TORCH_CHECK(c.dim() == 2 && c.size(0) == T && c.size(1) == hd && s.sizes() == c.sizes(), kWhat, ": cos and sin [",
              T, ", ", hd, "] expected");
  const auto f = x_in.options().dtype(at::kFloat);
  at::Tensor x = x_in.to(at::kFloat).clone(at::MemoryFormat::Contiguous);  // (a bfloat16 one widened: exact)
  at::Tensor delta = x_in.new_empty({T, D}, f), h = x_in.new_empty({T, D}, f);
  at::Tensor qkv = x_in.new_empty({T, (H + 2 * Hkv) * hd}, f);
  at::Tensor q = x_in.new_empty({T, HD}, f), att = x_in.new_empty({T, HD}, f);
  at::Tensor gu = x_in.new_empty({T, 2 * I}, f), act = x_in.new_empty({T, I}, f);
  at::Tensor xq = x_in.new_empty({T * widest_}, f.dtype(at::kChar));
  at::Tensor scales = x_in.new_empty({T * widest_ / raw::kBlockInputs}, f);
  at::Tensor sums = x_in.new_empty({2 * T * widest_ / raw::kBlockInputs}, f.dtype(at::kInt));
  at::Tensor dxsums = x_in.new_empty({T * widest_ / raw::kBlockInputs}, f);
  const raw::BlockActs acts{xq.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data_ptr<int32_t>(),
                            dxsums.data_ptr<float>()};
  float* X = x.data_ptr<float>();
  float* Dl = delta.data_ptr<float>();
  float* Hn = h.data_ptr<float>();
  float* QKV = qkv.data_ptr<float>();
  float* Q = q.data_ptr<float>();
  float* A = att.data_ptr<float>();
  float* GU = gu.data_ptr<float>();
  float* Act = act.data_ptr<float>();
  const float* C = c.data_ptr<float>();
  const float* Sn = s.data_ptr<float>();
  const Isa dense_isa = machine_isa(), block_isa = raw::block_isa();
  const float scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
  const bool head_blocks = hd % raw::kBlockInputs == 0;  // each head's outputs whole blocks of o's input
  const bool silu_blocks = I % raw::kBlockInputs == 0;

#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
    // this thread's attention items (KV head, block of rows): by their cost (rows x keys seen), largest first, each
    // to the thread with the least so far; every thread computes the same deal. (Dealt in turn, 8 sequences of
    // unequal lengths left one thread waiting for the other at every layer.)
    std::vector<int64_t> my_items;
    {
      const int64_t items = Hkv * static_cast<int64_t>(row_blocks.size());
      std::vector<std::pair<int64_t, int64_t>> by_cost(items);  // (cost, item)
      for (int64_t item = 0; item < items; ++item) {
        const auto [j, r0, r1] = row_blocks[item / Hkv];
        by_cost[item] = {(r1 - r0) * (ps[j].end - ps[j].rows + r1 - ps[j].row0), item};  // (its last row's keys)
      }
      std::stable_sort(by_cost.begin(), by_cost.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<int64_t> load(n, 0);
      for (const auto& [cost, item] : by_cost) {
        const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
        load[least] += cost;
        if (least == tid) {
          my_items.push_back(item);
        }
      }
    }
    // the group's products of `in` (its 8-bit blocks in acts where it has some) into out [T, width], with biases
    auto products = [&](const StepGroup& g, const float* in, float* out) {
      auto [a, b] = share(g.units(), tid, n);
      int64_t base = 0;
      raw::TiledActs tiled;  // (acts by row tile: made once for the group's block products, at the first in range)
      bool tiled_made = false;
      for (const StepProduct& p : g.products) {
        const int64_t lo = std::max(a, base) - base, hi = std::min(b, base + p.units()) - base;
        base += p.units();
        if (lo >= hi) {
          continue;
        }
        if (p.blocks) {
          if (!tiled_made) {
            tiled = raw::tile_acts(acts, T, p.w.K, block_isa);
            tiled_made = true;
          }
          raw::block_tiles(p.w, acts, tiled, T, out + p.offset, g.width, lo, hi, block_isa);
        } else if (bf16) {  // (each sum rounded to bfloat16)
          raw::dense_range(in, p.dense16, out + p.offset, g.width, T, p.K, lo * p.unit(),
                           std::min(p.N, hi * p.unit()), dense_isa);
        } else {
          raw::dense_range(in, p.dense, nullptr, out + p.offset, g.width, T, p.K, lo * p.unit(),
                           std::min(p.N, hi * p.unit()), dense_isa);
        }
        const int64_t c0 = p.offset + lo * p.unit(), c1 = p.offset + std::min(p.N, hi * p.unit());  // its columns
        for (const StepBias& bias : g.biases) {
          const int64_t b0 = std::max(c0, bias.offset), b1 = std::min(c1, bias.offset + bias.n);
          for (int64_t t = 0; t < T; ++t) {
            for (int64_t col = b0; col < b1; ++col) {
              out[t * g.width + col] += bias.values[col - bias.offset];
            }
          }
        }
      }
#pragma omp barrier
    };
    // x += delta (not before the first layer), h = its norm, h's 8-bit blocks where the next group reads them
    auto residual_norm = [&](bool add, const float* weight, bool quantized) {
      auto [a, b] = share(T, tid, n);
      for (int64_t t = a; t < b; ++t) {
        float* xt = X + t * D;
        if (add) {
          raw::add_rows(xt, Dl + t * D, D, bf16);
        }
        raw::norm_row(xt, weight, Hn + t * D, D, eps_, bf16);
        if (quantized) {
          raw::quantize_blocks(Hn, acts, t * D / raw::kBlockInputs, (t + 1) * D / raw::kBlockInputs);
        }
      }
#pragma omp barrier
    };
    for (int64_t i = 0; i < L; ++i) {
      const StepLayer& layer = layers_[i];
      residual_norm(i > 0, layer.attn_norm, layer.qkv.quantized);
      products(layer.qkv, Hn, QKV);
      {  // RoPE of each row's q and k heads (k into the cache), its v heads copied into the cache
        const int64_t heads = H + 2 * Hkv;
        auto [a, b] = share(T * heads, tid, n);
        for (int64_t item = a; item < b; ++item) {
          const int64_t t = item / heads, j = item % heads;
          const float* in = QKV + t * heads * hd + j * hd;
          if (j < H) {
            raw::rope_row(in, C + t * hd, Sn + t * hd, Q + t * HD + j * hd, hd, bf16);
            continue;
          }
          const bool key = j < H + Hkv;
          const Part& p = ps[part_of[t]];
          // in its part's layer i [Hkv, S, hd]
          const int64_t slot = ((i * Hkv + (key ? j - H : j - H - Hkv)) * p.S + p.start + t - p.row0) * hd;
          float rotated[kMaxHeadDim];
          float* to = bf16 ? rotated : (key ? p.k : p.v) + slot;  // (float32: straight into the cache)
          if (key) {
            raw::rope_row(in, C + t * hd, Sn + t * hd, to, hd, bf16);
          } else {
            std::memcpy(to, in, sizeof(float) * hd);
          }
          if (bf16) {  // bfloat16 values into the cache's bits (exact)
            uint16_t* bits = (key ? p.k16 : p.v16) + slot;
            for (int64_t e = 0; e < hd; ++e) {
              bits[e] = c10::BFloat16(rotated[e]).x;
            }
          }
        }
      }
#pragma omp barrier
      {  // attention, a KV head's query heads over a part's block of rows at a time (and their outputs' 8-bit
         // blocks), each thread its own (my_items: dealt by cost; a prompt's later rows see more keys, and a run
         // of them on one thread kept the other waiting). A KV head's G query heads go together, so that one
         // thread reads its keys and values once for all of them (one query head an item, both threads read every
         // KV head of every sequence: a batched forward of 8 sequences at 300 positions, 16 rows, took 19.0-20.6
         // ms against 31.7-32.2 without them, a 769-token prompt's 0.85 s against 1.64, on a 2-core AMD EPYC);
         // the same bits
        for (const int64_t item : my_items) {
          const int64_t g = item % Hkv, head = g * G;  // its KV head, its first query head
          const auto [j, r0, r1] = row_blocks[item / Hkv];
          const Part& p = ps[j];
          const int64_t layer_at = (i * Hkv + g) * p.S * hd;  // its layer's KV head in the part's caches
          const float* qp = Q + p.row0 * HD + head * hd;  // the part's row 0
          float* out = A + p.row0 * HD + head * hd;
          if (bf16) {  // (its outputs rounded to bfloat16, as the op's are)
            raw::attend(qp, HD, p.k16 + layer_at, p.v16 + layer_at, hd, p.seen, p.rows, p.end, r0 - p.row0,
                        r1 - p.row0, G, hd, scale, out, HD);
            for (int64_t t = r0; t < r1; ++t) {
              raw::round_bf16(A + t * HD + head * hd, G * hd);
            }
          } else {
            raw::attend(qp, HD, p.k + layer_at, p.v + layer_at, hd, p.seen, p.rows, p.end, r0 - p.row0, r1 - p.row0,
                        G, hd, scale, out, HD);
          }
          if (layer.o.quantized && head_blocks) {
            for (int64_t t = r0; t < r1; ++t) {
              const int64_t first = (t * HD + head * hd) / raw::kBlockInputs;
              raw::quantize_blocks(A, acts, first, first + G * hd / raw::kBlockInputs);
            }
          }
        }
      }
#pragma omp barrier
      if (layer.o.quantized && !head_blocks) {
        auto [a, b] = share(T * HD / raw::kBlockInputs, tid, n);
        raw::quantize_blocks(A, acts, a, b);
#pragma omp barrier
      }
      products(layer.o, A, Dl);
      residual_norm(true, layer.mlp_norm, layer.gate_up.quantized);
      products(layer.gate_up, Hn, GU);
      {  // silu(gate) * up, a block of 32 (or a row) at a time, and its 8-bit blocks, kQuantizeRun items' at a time
         // (not one block a call)
        const int64_t width = silu_blocks ? raw::kBlockInputs : I, per_row = I / width;
        auto [a, b] = share(T * per_row, tid, n);
        for (int64_t run = a; run < b; run += kQuantizeRun) {
          const int64_t stop = std::min(b, run + kQuantizeRun);
          for (int64_t item = run; item < stop; ++item) {
            const int64_t t = item / per_row, j = item % per_row * width;
            raw::silu_mul_row(GU + t * 2 * I + j, GU + t * 2 * I + I + j, Act + t * I + j, width, bf16);
          }
          if (layer.down.quantized) {  // (items [run, stop) are Act's consecutive widths from run * width)
            raw::quantize_blocks(Act, acts, run * width / raw::kBlockInputs, stop * width / raw::kBlockInputs);
          }
        }
      }
#pragma omp barrier
      products(layer.down, Act, Dl);
    }
  }
  if (bf16) {  // (bfloat16 values: exact)
    return {x.to(at::kBFloat16), delta.to(at::kBFloat16)};
  }
  return {x, delta};
}

}  // namespace casspec
