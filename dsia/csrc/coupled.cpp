// Coupled drafting's next tokens in one call (torch.ops.casspec.coupled_top; dytc/sampling.py's `coupled_top`): for
// each row of a draft level's logits, the k best of log warp(q) + g over the tokens the warp keeps (top-k, top-p),
// g the position-owned Gumbel noise the verifier draws the target's token with (gumbel.cpp), and the softmax of
// those perturbed scores at them. From Python it was a dozen small ATen ops a row (about 200 us a call on a 2-core
// AMD EPYC, 2.6 ms a sampled step of dytc); here one pass over the row (rowtop.cpp) and a few dozen scalars.
//
// Row r, its M = `candidates` largest logits x_1 >= .. >= x_M (ties: lower index first) and lse, the log-sum-exp
// of x / temperature over the whole row: z_i = x_i / temperature; with top_k > 0 (<= M), z_i = -inf past the top_k-th
// and the norm is the first top_k's log-sum-exp (else lse); with top_p < 1, p_i = e^(z_i - norm), before_i = (p_1 + .. + p_i,
// summed in double, as float) - p_i, and z_i = -inf where before_i >= top_p (ATen's float32 cumsum and warp's
// rule). The row's support lies within its candidates (`inside`) where top_k > 0 (top_k <= M), or top_p < 1 and
// before_M >= top_p, or M = V; only then are its results defined (tokens -1, probs 0 otherwise: the caller warps
// those rows whole). s_i = z_i + g(position_r, token_i) in double for the live z_i (the others -inf); the k best s_i
// (ties: the more likely candidate first) give tokens and e^(s_i - log-sum-exp of s) as probs; past the live ones
// the next candidates follow with probability 0.
#include "ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace casspec {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// row r's outputs (probs, tokens [k]) from its candidates' logits val and tokens idx [M] and its log-sum-exp;
// returns whether its support lies within the candidates
bool coupled_row(const float* val, const int64_t* idx, float lse, int64_t M, int64_t V, float temperature,
                 int64_t top_k, double top_p, int64_t seed, int64_t position, int64_t k, float* probs,
                 int64_t* tokens) {
  std::vector<float> z(M);
  for (int64_t i = 0; i < M; ++i) {
    z[i] = val[i] / temperature;
  }
  int64_t live = M;  // the support is z's first `live` entries (a prefix: the candidates descend)
  float norm = lse;
  if (top_k > 0) {  // (top_k <= M)
    live = top_k;
    double sum = 0.0;
    for (int64_t i = 0; i < live; ++i) {
      sum += std::exp(static_cast<double>(z[i]) - z[0]);
    }
    norm = static_cast<float>(z[0] + std::log(sum));
  }
  bool inside = top_k > 0 || M == V;
  if (top_p < 1.0) {
    const float nucleus = static_cast<float>(top_p);  // (compared in float, as ATen compares a float tensor)
    double cum = 0.0;
    int64_t cut = live;
    for (int64_t i = 0; i < live; ++i) {
      const float p = std::exp(z[i] - norm);
      cum += p;
      const float before = static_cast<float>(cum) - p;
      if (before >= nucleus && cut == live) {
        cut = i;  // (before only grows: every later entry is dropped too)
      }
      if (i == M - 1 && top_k == 0) {
        inside = before >= nucleus || M == V;
      }
    }
    live = cut;  // (at least the first token: its before is 0)
  }
  if (!inside) {
    std::fill(probs, probs + k, 0.0f);
    std::fill(tokens, tokens + k, int64_t{-1});
    return false;
  }
  std::vector<double> s(live);
  gumbel_tokens(seed, position, idx, live, s.data());
  double most = kNegInf;
  for (int64_t i = 0; i < live; ++i) {
    s[i] += z[i];
    most = std::max(most, s[i]);
  }
  double sum = 0.0;
  for (int64_t i = 0; i < live; ++i) {
    sum += std::exp(s[i] - most);
  }
  const double log_total = most + std::log(sum);
  std::vector<int64_t> order(live);
  for (int64_t i = 0; i < live; ++i) {
    order[i] = i;
  }
  const int64_t best = std::min(k, live);
  std::partial_sort(order.begin(), order.begin() + best, order.end(),
                    [&](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
  for (int64_t j = 0; j < k; ++j) {
    const bool scored = j < best;
    tokens[j] = idx[scored ? order[j] : live + (j - best)];
    probs[j] = scored ? static_cast<float>(std::exp(s[order[j]] - log_total)) : 0.0f;
  }
  return true;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> coupled_top(const at::Tensor& logits, double temperature, int64_t top_k,
                                                           double top_p, int64_t seed, const at::Tensor& positions,
                                                           int64_t k, int64_t candidates) {
  check_tensor(logits, "coupled_top logits [T, V]", at::kFloat, 2);
  check_tensor(positions, "coupled_top positions [T]", at::kLong, 1);
  const int64_t T = logits.size(0), V = logits.size(1);
  TORCH_CHECK(positions.size(0) == T, "casspec coupled_top: one position per row expected (", T, "), got ",
              positions.size(0));
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, "casspec coupled_top: a finite temperature > 0 "
              "expected, got ", temperature);
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "casspec coupled_top: top_p must lie in (0, 1], got ", top_p);
  TORCH_CHECK(candidates >= 1 && candidates <= V, "casspec coupled_top: candidates must lie in 1..", V, ", got ",
              candidates);
  TORCH_CHECK(top_k >= 0 && top_k <= candidates, "casspec coupled_top: top_k must lie in 0..", candidates,
              " (the candidates), got ", top_k);
  TORCH_CHECK(k >= 1 && k <= candidates, "casspec coupled_top: k must lie in 1..", candidates, ", got ", k);
  TORCH_CHECK(seed >= 0, "casspec coupled_top: a seed >= 0 expected, got ", seed);
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r) {
    TORCH_CHECK(pp[r] >= 0, "casspec coupled_top: positions must be >= 0, got ", pp[r]);
  }
  auto [val, idx, lse] = row_top_lse(logits, candidates, 1.0 / temperature);  // [T, M], [T, M], [T]
  at::Tensor probs = at::empty({T, k}, logits.options());
  at::Tensor tokens = at::empty({T, k}, logits.options().dtype(at::kLong));
  at::Tensor inside = at::empty({T}, logits.options().dtype(at::kBool));
  const float* vp = val.data_ptr<float>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* lp = lse.data_ptr<float>();
  bool* in = inside.data_ptr<bool>();
  for (int64_t r = 0; r < T; ++r) {  // (a few rows of a few dozen scalars each: one thread)
    in[r] = coupled_row(vp + r * candidates, ip + r * candidates, lp[r], candidates, V,
                        static_cast<float>(temperature), top_k, top_p, seed, pp[r], k,
                        probs.data_ptr<float>() + r * k, tokens.data_ptr<int64_t>() + r * k);
  }
  return {probs, tokens, inside};
}

}  // namespace casspec
