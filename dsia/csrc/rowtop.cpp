// The k largest entries of each row of a [T, V] float32 tensor, and the row's log-sum-exp, in one pass over a large
// vocabulary (torch.ops.casspec.row_top, row_top_lse): what a draft level's next tokens and their probabilities need
// (dsia/topk.py). From ATen they were a softmax over the whole row and a top-k over it, or a log-sum-exp and a
// top-k: several passes, 50-190 us a row over 49k tokens on a 2-core AMD EPYC.
//
// The top k: a sorted list of the k best so far (descending; of equal values the one seen first, the lower index,
// first), and a scan of the row 256 floats at a time that looks into a block, 16 at a time, only where its maximum
// beats the k-th best (after the first blocks, seldom). NaN is read as -infinity (below every number).
// The log-sum-exp of scale * x: m + log(sum e^(scale * x - m)), m the scaled maximum, summed in 16 lanes folded in a
// fixed order, so a row gives the same bits whatever the rows beside it; a NaN entry makes it NaN (as torch's) where
// the row holds a number, -inf in a row of NaN and -inf alone.
#include "ops.h"

#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace casspec {
namespace {

constexpr int64_t kBlock = 16 * kLanes;  // floats the scan compares with the k-th best at once
constexpr int64_t kParallelRows = 1 << 16;  // rows of more floats than this in all run on every thread
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

[[gnu::always_inline]] inline float no_nan(float v) { return v == v ? v : kNegInf; }

// lane-wise the larger of most and b, b only where it is a number above most: most never NaN where it was not
// (the select written on its comparison: GCC emits a vector max; an equality's mask, or a select on a mask computed
// apart, it emitted lane by lane)
[[gnu::always_inline]] inline v16 vmax(v16 most, v16 b) { return b > most ? b : most; }

// the largest lane of v, no lane NaN, folded in halves as `fold` sums
[[gnu::always_inline]] inline float lanes_max(v16 v) {
  v = vmax(v, __builtin_shuffle(v, i16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmax(v, __builtin_shuffle(v, i16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = vmax(v, __builtin_shuffle(v, i16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = vmax(v, __builtin_shuffle(v, i16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}

// value x at index i into the sorted lists (val, idx) of n <= k entries, where it beats the k-th (or there is room)
[[gnu::always_inline]] inline void offer(float* val, int64_t* idx, int64_t& n, int64_t k, float x, int64_t i) {
  if (n == k && !(x > val[k - 1])) {
    return;
  }
  int64_t at = n < k ? n++ : k - 1;  // the slot freed: a new one, or the k-th's
  while (at > 0 && x > val[at - 1]) {  // (strictly: an equal value seen earlier stays before it)
    val[at] = val[at - 1];
    idx[at] = idx[at - 1];
    --at;
  }
  val[at] = x;
  idx[at] = i;
}

// one row x [V]: its k best into val, idx [k] and, where lse is not null, the log-sum-exp of scale * x into *lse
[[gnu::always_inline]] inline void row_impl(const float* x, int64_t V, int64_t k, float* val, int64_t* idx,
                                            float scale, float* lse) {
  int64_t n = 0, i = 0;
  for (; i < V && n < k; ++i) {  // the first k entries fill the list
    offer(val, idx, n, k, no_nan(x[i]), i);
  }
  for (; i + kBlock <= V; i += kBlock) {  // then whole blocks, looked into only where one beats the k-th best, and
    // within one, its vectors of 16 likewise
    v16 most = v16{} + kNegInf;
#pragma GCC unroll 16
    for (int64_t c = 0; c < kBlock / kLanes; ++c) {
      most = vmax(most, load(x + i + c * kLanes));
    }
    if (!(lanes_max(most) > val[k - 1])) {
      continue;
    }
    for (int64_t c = i; c < i + kBlock; c += kLanes) {
      if (lanes_max(vmax(v16{} + kNegInf, load(x + c))) > val[k - 1]) {
        for (int64_t j = c; j < c + kLanes; ++j) {
          offer(val, idx, n, k, no_nan(x[j]), j);
        }
      }
    }
  }
  for (; i < V; ++i) {  // the tail
    offer(val, idx, n, k, no_nan(x[i]), i);
  }
  if (lse == nullptr) {
    return;
  }
  const float top = val[0];
  if (top == kNegInf || top == -kNegInf) {  // every entry -inf or NaN: the sum is 0; an entry +inf: it is +inf
    *lse = top;
    return;
  }
  const v16 m = v16{} + top * scale;
  v16 sum = {};
  for (int64_t j = 0; j < V; j += kLanes) {
    const int64_t w = std::min(kLanes, V - j);
    v16 e = vexp(load(x + j, w) * scale - m);  // (e^(x s - m) <= 1; below float's range, and at -inf, 0)
    for (int64_t l = w; l < kLanes; ++l) {  // lanes past the row add nothing
      e[l] = 0.0f;
    }
    sum += e;
  }
  *lse = top * scale + std::log(fold(sum));
}

// rows [r0, r1) of x [T, V] (row_impl), one function per instruction set (the same code, so the same bits)
#define CASSPEC_ROWS_BODY                                                                                      \
  for (int64_t r = r0; r < r1; ++r) {                                                                          \
    row_impl(x + r * V, V, k, val + r * k, idx + r * k, scale, lse == nullptr ? nullptr : lse + r);            \
  }
#define CASSPEC_ROWS_ARGS                                                                                      \
  const float *x, int64_t V, int64_t r0, int64_t r1, int64_t k, float *val, int64_t *idx, float scale, float *lse
void rows_plain(CASSPEC_ROWS_ARGS) { CASSPEC_ROWS_BODY }
__attribute__((target("avx2"))) void rows_avx2(CASSPEC_ROWS_ARGS) { CASSPEC_ROWS_BODY }
__attribute__((target("avx512f"))) void rows_avx512(CASSPEC_ROWS_ARGS) { CASSPEC_ROWS_BODY }

// both ops: x [T, V] float32, k in 1..V (each insertion costs up to k moves: for a small k); lse over scale * x
// where `with_lse`
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_of_rows(const at::Tensor& x_in, int64_t k, double scale,
                                                           bool with_lse) {
  check_tensor(x_in, "row_top x [T, V]", at::kFloat, 2);
  const int64_t T = x_in.size(0), V = x_in.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "casspec row_top: k must lie in 1..", V, " (the row's entries), got ", k);
  TORCH_CHECK(!with_lse || (std::isfinite(scale) && scale > 0.0), "casspec row_top_lse: a finite scale > 0 expected,"
              " got ", scale);
  const at::Tensor x = x_in.contiguous();
  at::Tensor val = x.new_empty({T, k});
  at::Tensor idx = x.new_empty({T, k}, x.options().dtype(at::kLong));
  at::Tensor lse = x.new_empty({with_lse ? T : 0});
  const float* xp = x.data_ptr<float>();
  float* vp = val.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* lp = with_lse ? lse.data_ptr<float>() : nullptr;
  const float s = static_cast<float>(scale);
  const Isa isa = machine_isa();
  const int64_t grain = T * V > kParallelRows ? 1 : std::max<int64_t>(1, T);
  at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
    if (isa == kAvx512) {
      rows_avx512(xp, V, r0, r1, k, vp, ip, s, lp);
    } else if (isa == kAvx2) {
      rows_avx2(xp, V, r0, r1, k, vp, ip, s, lp);
    } else {
      rows_plain(xp, V, r0, r1, k, vp, ip, s, lp);
    }
  });
  return {val, idx, lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> row_top(const at::Tensor& x, int64_t k) {
  auto [val, idx, lse] = top_of_rows(x, k, 1.0, false);
  return {val, idx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> row_top_lse(const at::Tensor& x, int64_t k, double scale) {
  return top_of_rows(x, k, scale, true);
}

}  // namespace casspec
