// A float32 forward's small steps as one loop each, for the CPU (torch.ops.casspec.*): RMSNorm (with the residual
// add before it), RoPE and attention. Called from ATen each of them is several operations of microseconds over a
// few hundred numbers (an RMSNorm is eight); here one. Both layer loops call these (dsia/fastloop.py: the C++ loop
// directly, the Python loop through the ops), so the two give the same bits.
//
// Every row is computed by the same code whatever the rows beside it, in a fixed order: the attention of a query
// row sums over its own keys in position order (masked ones skipped, not zeroed), so a tree's row and a one-token
// step over the same keys give the same bits (batch-invariant by construction). Sums run in 16 lanes (a vector
// of 16 floats, however wide the machine's registers) folded in a fixed order; built with -ffp-contract=off, no
// multiply-add is fused behind the code's back, so RoPE is the bits of ATen's x * cos + roll(x) * sin.
#include "ops.h"

#include "fold512.h"
#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace casspec {
namespace {

// each lane rounded to bfloat16's precision (round_bf16, ops.h)
[[gnu::always_inline]] inline v16 to_bf16(v16 v) {
  v16 out;
#pragma GCC unroll 16
  for (int64_t i = 0; i < kLanes; ++i) {
    out[i] = round_bf16(v[i]);
  }
  return out;
}

// silu(g) * u in every lane: g * sigmoid(g) * u, sigmoid from e^-|g| (never overflows: 1 / (1 + e) at g >= 0,
// e / (1 + e) below); Bf16: silu(g) rounded to bfloat16, then its product (as bfloat16 ops silu, then *)
template <bool Bf16>
[[gnu::always_inline]] inline v16 vsilu_mul(v16 g, v16 u) {
  const i16 negative = g < 0.0f;
  const v16 e = vexp(negative ? g : -g);
  const v16 sigmoid = (negative ? e : v16{} + 1.0f) / (e + 1.0f);
  if constexpr (Bf16) {
    return to_bf16(to_bf16(g * sigmoid) * u);
  }
  return g * sigmoid * u;
}

// silu(gate) * up over n elements, 16 at a time (the tail's lanes past n computed over zeros and not stored)
template <bool Bf16>
[[gnu::always_inline]] inline void silu_mul_impl(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t w = std::min(kLanes, n - j);
    store(out + j, vsilu_mul<Bf16>(load(gate + j, w), load(up + j, w)), w);
  }
}
template <bool Bf16>
__attribute__((target("avx512f"))) void silu_mul_avx512(const float* g, const float* u, float* o, int64_t n) {
  silu_mul_impl<Bf16>(g, u, o, n);
}
template <bool Bf16>
__attribute__((target("avx2"))) void silu_mul_avx2(const float* g, const float* u, float* o, int64_t n) {
  silu_mul_impl<Bf16>(g, u, o, n);
}

// one row: out = w * (x * 1 / sqrt(mean(x^2) + eps)), HF's order of the two products; Bf16: each product rounded to
// bfloat16 (HF's rounding: the normalized x cast to the weight's dtype, then scaled in it)
template <bool Bf16>
[[gnu::always_inline]] inline void norm_row_impl(const float* x, const float* w, float* out, int64_t D, double eps) {
  v16 acc = {};
  for (int64_t j = 0; j < D; j += kLanes) {
    v16 v = load(x + j, std::min(kLanes, D - j));
    acc += v * v;
  }
  const float r = 1.0f / std::sqrt(fold(acc) / static_cast<float>(D) + static_cast<float>(eps));
  for (int64_t j = 0; j < D; j += kLanes) {
    const int64_t n = std::min(kLanes, D - j);
    if constexpr (Bf16) {
      store(out + j, to_bf16(load(w + j, n) * to_bf16(load(x + j, n) * r)), n);
    } else {
      store(out + j, load(w + j, n) * (load(x + j, n) * r), n);
    }
  }
}

template <bool Bf16>
__attribute__((target("avx512f"))) void norm_row_avx512(const float* x, const float* w, float* out, int64_t D,
                                                        double eps) {
  norm_row_impl<Bf16>(x, w, out, D, eps);
}
template <bool Bf16>
__attribute__((target("avx2"))) void norm_row_avx2(const float* x, const float* w, float* out, int64_t D, double eps) {
  norm_row_impl<Bf16>(x, w, out, D, eps);
}

// the row's norm by the widest path (the same bits in every one)
template <bool Bf16>
void norm_row(const float* x, const float* w, float* out, int64_t D, double eps) {
  static const Isa isa = machine_isa();
  if (isa == kAvx512) {
    norm_row_avx512<Bf16>(x, w, out, D, eps);
  } else if (isa == kAvx2) {
    norm_row_avx2<Bf16>(x, w, out, D, eps);
  } else {
    norm_row_impl<Bf16>(x, w, out, D, eps);
  }
}

// Which keys each query row of an attention sees: mask [T, end] (bool, row-major), or none: row t sits at slot
// end - T + t and sees every slot up to its own.
struct Visible {
  const bool* mask;  // or nullptr
  int64_t T, end;
};

// Row r's scores of 16 keys (float32, k_stride apart) with an AVX-512 path's registers: key i's q . k as `attend_impl`
// computes it per key (lane-wise products of the head's chunks, summed chunk by chunk), the 16 folds at once,
// times scale, into out[0..16). Returns 16. (A call, not inlined: its caller is compiled for every path.)
template <int64_t C>
__attribute__((target("avx512f"))) int64_t block16(const float* qh, const float* keys, int64_t k_stride, float scale,
                                                  float* out) {
  __m512 qc[C], d[16];
#pragma GCC unroll 8
  for (int64_t c = 0; c < C; ++c) {
    qc[c] = _mm512_loadu_ps(qh + c * 16);
  }
#pragma GCC unroll 16
  for (int64_t i = 0; i < 16; ++i) {
    const float* k = keys + i * k_stride;
    __m512 s = _mm512_mul_ps(qc[0], _mm512_loadu_ps(k));
#pragma GCC unroll 8
    for (int64_t c = 1; c < C; ++c) {
      s = _mm512_add_ps(s, _mm512_mul_ps(qc[c], _mm512_loadu_ps(k + c * 16)));
    }
    d[i] = s;
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(fold16x16(d), _mm512_set1_ps(scale)));
  return 16;
}

// The slots a query row sees: all of [0, prefix), then `extra` (ascending: a tree's scratch slots past its prefix)
struct RowSlots {
  int64_t prefix = 0;
  std::vector<int64_t> extra;
  int64_t count() const { return prefix + static_cast<int64_t>(extra.size()); }
};

// row t's slots as `seen` says (one pass over its mask row; none without a mask)
inline void row_slots(const Visible& seen, int64_t t, RowSlots& out) {
  out.extra.clear();
  if (seen.mask == nullptr) {
    out.prefix = seen.end - seen.T + t + 1;
    return;
  }
  const bool* m = seen.mask + t * seen.end;
  const void* hole = std::memchr(m, 0, seen.end);  // (a bool is one byte, 0 or 1)
  out.prefix = hole == nullptr ? seen.end : static_cast<const bool*>(hole) - m;
  for (int64_t j = out.prefix; j < seen.end; ++j) {
    if (m[j]) {
      out.extra.push_back(j);
    }
  }
}

// The scores of rows' prefix keys 16 at a time (the whole blocks of each row's prefix), each block made dimension-major
// once for every row and head (keys_by_dim) and scored by block16_by_dim: the bits block16 gives. qv: R rows x G heads
// of `C` chunks; row r, head h's scores at scores + first[r] + h * padded[r]. (A call, not inlined, as block16.)
template <int64_t C>
__attribute__((target("avx512f"))) void scores_by_dim(const float* qv, const float* keys, int64_t k_stride,
                                                      const RowSlots* slots, const int64_t* first,
                                                      const int64_t* padded, int64_t R, int64_t G, float scale,
                                                      float* scores) {
  int64_t most = 0;
  for (int64_t r = 0; r < R; ++r) {
    most = std::max(most, slots[r].prefix);
  }
  alignas(64) float kt[C * kLanes * kLanes];  // [C * 16 dims, 16 keys]
  for (int64_t j = 0; j + kLanes <= most; j += kLanes) {
    keys_by_dim<C>(keys + j * k_stride, k_stride, kt);
    for (int64_t r = 0; r < R; ++r) {
      if (slots[r].prefix < j + kLanes) {
        continue;
      }
      for (int64_t h0 = 0; h0 < G; h0 += 2) {  // up to 2 heads at a time
        const float* qh[2];
        float* out[2];
        const int64_t U = std::min<int64_t>(2, G - h0);
        for (int64_t u = 0; u < U; ++u) {
          qh[u] = qv + (r * G + h0 + u) * C * kLanes;
          out[u] = scores + first[r] + (h0 + u) * padded[r] + j;
        }
        if (U == 2) {
          block16_by_dim<C, 2>(qh, kt, scale, out);
        } else {
          block16_by_dim<C, 1>(qh, kt, scale, out);
        }
      }
    }
  }
}

// heads whose weighted sums of values go together (each value chunk loaded once for them, their accumulators in
// registers): as many as 16 registers hold
template <int64_t C>
constexpr int64_t kHeadsTogether = C == 0 ? 1 : std::max<int64_t>(1, 16 / C);

// the floats of a head's chunk c (16 but in the last chunk of a head dim no multiple of 16); C as attend_impl's
template <int64_t C>
[[gnu::always_inline]] inline int64_t chunk_width(int64_t c, int64_t hd) {
  return C > 0 && C * kLanes == hd ? kLanes : std::min(kLanes, hd - c * kLanes);
}

// U heads' weighted sums of the values a row sees (head u's numerators p[u] in the row's order of slots, their sum
// total[u]), each head adding its terms in position order: out + u * hd
template <int64_t U, int64_t C, class KV>
[[gnu::always_inline]] inline void weighted_values(const float* const* p, const RowSlots& sl, const KV* values,
                                                   int64_t v_stride, int64_t hd, const float* total, float* out) {
  constexpr int64_t kMaxChunks = kMaxHeadDim / kLanes;
  const int64_t chunks = C > 0 ? C : (hd + kLanes - 1) / kLanes;
  auto width = [&](int64_t c) { return chunk_width<C>(c, hd); };
  v16 acc[U][C > 0 ? C : kMaxChunks];
#pragma GCC unroll 16
  for (int64_t u = 0; u < U; ++u) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < chunks; ++c) {
      acc[u][c] = v16{};
    }
  }
  auto add = [&](int64_t i, int64_t j) {  // the row's score i, slot j's value
    const KV* v = values + j * v_stride;
#pragma GCC unroll 16
    for (int64_t c = 0; c < chunks; ++c) {
      const v16 vc = load(v + c * kLanes, width(c));
#pragma GCC unroll 8
      for (int64_t u = 0; u < U; ++u) {
        acc[u][c] += p[u][i] * vc;
      }
    }
  };
  for (int64_t j = 0; j < sl.prefix; ++j) {
    add(j, j);
  }
  for (int64_t k = 0; k < static_cast<int64_t>(sl.extra.size()); ++k) {
    add(sl.prefix + k, sl.extra[k]);
  }
#pragma GCC unroll 8
  for (int64_t u = 0; u < U; ++u) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < chunks; ++c) {
      store(out + u * hd + c * kLanes, acc[u][c] / total[u], width(c));
    }
  }
}

// Rows [r0, r1) (R of them), each with G query heads (row r, head h at q + r * q_row + h * q_head), attending over
// the keys they see of one KV head: out row r, head h at out + r * out_row + h * hd. Each row's scores are kept in
// its own order of keys (position order) and each head's weighted sum of values adds them in that order, so what a
// row gets does not depend on the rows beside it (nor on which heads share a value's load). C: the head's 16-float
// chunks, a constant for the usual head dims (their chunks then stay in registers; 0: any hd up to 256).
template <int64_t C, class KV, bool Wide>
[[gnu::always_inline]] inline void attend_impl(const float* q, int64_t q_row, int64_t q_head, const KV* keys,
                                               int64_t k_stride, const KV* values, int64_t v_stride,
                                               const Visible& seen, int64_t r0, int64_t r1, int64_t G, int64_t hd,
                                               float scale, float* out, int64_t out_row) {
  const int64_t chunks = C > 0 ? C : (hd + kLanes - 1) / kLanes, R = r1 - r0;
  auto width = [&](int64_t c) { return chunk_width<C>(c, hd); };
  // row r sees slots[r]; its scores are G runs of padded[r] floats (its count rounded up to 16) from first[r]
  std::vector<RowSlots> slots(R);
  std::vector<int64_t> first(R + 1, 0), padded(R);
  for (int64_t r = 0; r < R; ++r) {
    row_slots(seen, r0 + r, slots[r]);
    padded[r] = (slots[r].count() + kLanes - 1) / kLanes * kLanes;
    first[r + 1] = first[r] + G * padded[r];
  }
  std::vector<float> scores(first[R]);
  // each row's heads' queries, in 16-float chunks (a float buffer: a vector type's alignment does not survive as a
  // template argument)
  std::vector<float> qv(R * G * chunks * kLanes);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t h = 0; h < G; ++h) {
#pragma GCC unroll 16
      for (int64_t c = 0; c < chunks; ++c) {
        store(qv.data() + ((r * G + h) * chunks + c) * kLanes,
              load(q + (r0 + r) * q_row + h * q_head + c * kLanes, width(c)));
      }
    }
  }
  // key j's score for query chunks qh: the lane-wise products summed chunk by chunk, folded, times scale
  auto score = [&](const float* qh, int64_t j) {
    const KV* k = keys + j * k_stride;
    v16 d = load(qh) * load(k, width(0));
#pragma GCC unroll 16
    for (int64_t c = 1; c < chunks; ++c) {
      d += load(qh + c * kLanes) * load(k + c * kLanes, width(c));
    }
    return fold(d) * scale;
  };
  // scores, per row and head in position order; on AVX-512 (float32 keys, 64- or 128-float heads) 16 keys of the
  // prefix at once: the same products and sums, the 16 folds together (fold512.h)
  constexpr bool kBlocks16 = Wide && std::is_same_v<KV, float> && (C == 4 || C == 8);
  // with enough rows and heads, each block of 16 prefix keys turned dimension-major once for them all and scored
  // without shuffles (scores_by_dim: the same bits as block16)
  const bool by_dim = kBlocks16 && R * G >= kByDimHeads;
  if constexpr (kBlocks16) {
    if (by_dim) {
      scores_by_dim<C>(qv.data(), reinterpret_cast<const float*>(keys), k_stride, slots.data(), first.data(),
                       padded.data(), R, G, scale, scores.data());
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const RowSlots& sl = slots[r];
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qv.data() + (r * G + h) * chunks * kLanes;
      float* row = scores.data() + first[r] + h * padded[r];
      int64_t j = 0;
      if constexpr (kBlocks16) {
        if (by_dim) {
          j = sl.prefix / kLanes * kLanes;
        }
        for (; j + kLanes <= sl.prefix; j += kLanes) {
          block16<C>(qh, reinterpret_cast<const float*>(keys) + j * k_stride, k_stride, scale, row + j);
        }
      }
      for (; j < sl.prefix; ++j) {
        row[j] = score(qh, j);
      }
      for (const int64_t e : sl.extra) {
        row[j++] = score(qh, e);
      }
    }
  }
  std::vector<float> total(R * G);
  for (int64_t r = 0; r < R; ++r) {  // softmax's numerators e^(s - max), and their sum, per row and head
    const int64_t count = slots[r].count();
    for (int64_t h = 0; h < G; ++h) {
      float* p = scores.data() + first[r] + h * padded[r];
      std::fill(p + count, p + padded[r], -std::numeric_limits<float>::infinity());
      v16 most = load(p);
      for (int64_t i = kLanes; i < padded[r]; i += kLanes) {
        const v16 x = load(p + i);
        most = x > most ? x : most;
      }
      float top = most[0];
      for (int64_t i = 1; i < kLanes; ++i) {
        top = std::max(top, most[i]);
      }
      v16 sum = {};
      for (int64_t i = 0; i < padded[r]; i += kLanes) {
        const v16 e = vexp(load(p + i) - top);
        store(p + i, e);
        sum += e;
      }
      total[r * G + h] = fold(sum);
    }
  }
  // the weighted sums of the values, in position order, per row and head (up to kHeadsTogether heads at a time)
  constexpr int64_t HT = kHeadsTogether<C>;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t h0 = 0; h0 < G; h0 += HT) {
      const float* p[HT];
      for (int64_t u = 0; u < std::min(HT, G - h0); ++u) {
        p[u] = scores.data() + first[r] + (h0 + u) * padded[r];
      }
      float* o = out + (r0 + r) * out_row + h0 * hd;
      const float* t = total.data() + r * G + h0;
      switch (std::min(HT, G - h0)) {
        case 4:
          weighted_values<std::min<int64_t>(HT, 4), C>(p, slots[r], values, v_stride, hd, t, o);
          break;
        case 3:
          weighted_values<std::min<int64_t>(HT, 3), C>(p, slots[r], values, v_stride, hd, t, o);
          break;
        case 2:
          weighted_values<std::min<int64_t>(HT, 2), C>(p, slots[r], values, v_stride, hd, t, o);
          break;
        default:
          weighted_values<1, C>(p, slots[r], values, v_stride, hd, t, o);
          break;
      }
    }
  }
}

// hd's chunks as a constant for the usual head dims
template <class KV, bool Wide>
[[gnu::always_inline]] inline void attend_hd(const float* q, int64_t q_row, int64_t q_head, const KV* keys,
                                             int64_t k_stride, const KV* values, int64_t v_stride, const Visible& seen,
                                             int64_t r0, int64_t r1, int64_t G, int64_t hd, float scale, float* out,
                                             int64_t out_row) {
  switch (hd) {
    case 64:
      return attend_impl<4, KV, Wide>(q, q_row, q_head, keys, k_stride, values, v_stride, seen, r0, r1, G, hd,
                                        scale, out, out_row);
    case 128:
      return attend_impl<8, KV, Wide>(q, q_row, q_head, keys, k_stride, values, v_stride, seen, r0, r1, G, hd,
                                        scale, out, out_row);
    default:
      return attend_impl<0, KV, Wide>(q, q_row, q_head, keys, k_stride, values, v_stride, seen, r0, r1, G, hd,
                                        scale, out, out_row);
  }
}

// Compiled for AVX-512, AVX2 and the baseline, one picked by machine_isa(): the same lane-wise float operations in
// every one (no contraction into multiply-adds), so the same bits on every machine. Keys and values float32, or
// bfloat16 (their bits: widened exactly, then the same float32 operations).
#define CASSPEC_ATTEND_ARGS                                                                                       \
  const float *q, int64_t q_row, int64_t q_head, const KV *keys, int64_t k_stride, const KV *values,              \
      int64_t v_stride, const Visible &seen, int64_t r0, int64_t r1, int64_t G, int64_t hd, float scale, float *out, \
      int64_t out_row
#define CASSPEC_ATTEND_CALL q, q_row, q_head, keys, k_stride, values, v_stride, seen, r0, r1, G, hd, scale, out, out_row
template <class KV>
__attribute__((target("avx512f"))) void attend_avx512(CASSPEC_ATTEND_ARGS) {
  attend_hd<KV, true>(CASSPEC_ATTEND_CALL);
}
template <class KV>
__attribute__((target("avx2"))) void attend_avx2(CASSPEC_ATTEND_ARGS) {
  attend_hd<KV, false>(CASSPEC_ATTEND_CALL);
}
template <class KV>
void attend_plain(CASSPEC_ATTEND_ARGS) {
  attend_hd<KV, false>(CASSPEC_ATTEND_CALL);
}
template <class KV>
void attend(CASSPEC_ATTEND_ARGS) {
  static const Isa isa = machine_isa();
  if (isa == kAvx512) {
    attend_avx512(CASSPEC_ATTEND_CALL);
  } else if (isa == kAvx2) {
    attend_avx2(CASSPEC_ATTEND_CALL);
  } else {
    attend_plain(CASSPEC_ATTEND_CALL);
  }
}
#undef CASSPEC_ATTEND_ARGS
#undef CASSPEC_ATTEND_CALL

// x [T, D]: float32 or bfloat16 rows on the CPU, each read with unit stride
void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.defined() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "casspec ", what,
              ": float32 or bfloat16 expected");
  check_tensor(x, what, x.scalar_type(), 2);
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "casspec ", what, ": rows [T, D] with unit stride");
}

// weight [D] of a norm over rows of D in `dtype`, and a finite eps >= 0
void check_norm(const at::Tensor& weight, int64_t D, double eps, at::ScalarType dtype, const char* what) {
  check_tensor(weight, what, dtype, 1);
  TORCH_CHECK(weight.size(0) == D, "casspec ", what, ": weight of ", D, " values expected, got ", weight.size(0));
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "casspec ", what, ": eps must be finite and >= 0, got ", eps);
}

// A bfloat16 op computes in float32 on the values widened (exactly) and rounds each result where the bfloat16 ATen
// op rounds it: `Rows` reads a [T, D] row (unit stride) as floats, its own or widened into a buffer of its own, and
// writes one (bfloat16: narrowed, exactly, the values being rounded already).
struct Rows {
  const at::Tensor& t;
  bool bf16;
  std::vector<float> buf;
  Rows(const at::Tensor& tensor, int64_t D) : t(tensor), bf16(tensor.scalar_type() == at::kBFloat16) {
    if (bf16) {
      buf.resize(D);
    }
  }
  const float* read(int64_t at, int64_t D) {  // (at: the row's first element)
    if (!bf16) {
      return t.data_ptr<float>() + at;
    }
    const at::BFloat16* p = t.data_ptr<at::BFloat16>() + at;
    for (int64_t j = 0; j < D; ++j) {
      buf[j] = static_cast<float>(p[j]);
    }
    return buf.data();
  }
  float* target(int64_t at) { return bf16 ? buf.data() : t.data_ptr<float>() + at; }
  void written(int64_t at, int64_t D) {  // after target(at) was filled
    if (bf16) {
      at::BFloat16* p = t.data_ptr<at::BFloat16>() + at;
      for (int64_t j = 0; j < D; ++j) {
        p[j] = at::BFloat16(buf[j]);
      }
    }
  }
};

// a norm's weight as float32 (a bfloat16 one widened, exactly)
std::vector<float> widened(const at::Tensor& w) {
  const at::Tensor f = w.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

}  // namespace

Isa machine_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    Isa best = kPlain;
    if (__builtin_cpu_supports("avx512f")) {
      best = kAvx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      best = kAvx2;
    }
    const char* cap = std::getenv("CASSPEC_ISA");
    if (cap == nullptr || *cap == '\0') {
      return best;
    }
    const std::string name(cap);
    TORCH_CHECK(name == "plain" || name == "avx2" || name == "avx512", "CASSPEC_ISA=", name,
                " is not an instruction set casspec has paths for: use plain, avx2 or avx512, or unset it");
    return std::min(best, name == "plain" ? kPlain : name == "avx2" ? kAvx2 : kAvx512);
  }();
  return isa;
}

namespace raw {

void norm_row(const float* x, const float* w, float* out, int64_t D, double eps, bool bf16) {
  bf16 ? casspec::norm_row<true>(x, w, out, D, eps) : casspec::norm_row<false>(x, w, out, D, eps);
}

void rope_row(const float* x, const float* cos, const float* sin, float* out, int64_t hd, bool bf16) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < hd; ++j) {  // roll(x, hd / 2)[j] = x[(j + hd / 2) mod hd]; sin's first half negated
    const float a = x[j] * cos[j], b = x[j < half ? j + half : j - half] * sin[j];
    out[j] = bf16 ? casspec::round_bf16(casspec::round_bf16(a) + casspec::round_bf16(b)) : a + b;
  }
}

template <bool Bf16>
void silu_mul_on(const float* gate, const float* up, float* out, int64_t n) {
  static const Isa isa = machine_isa();
  if (isa == kAvx512) {
    silu_mul_avx512<Bf16>(gate, up, out, n);
  } else if (isa == kAvx2) {
    silu_mul_avx2<Bf16>(gate, up, out, n);
  } else {
    silu_mul_impl<Bf16>(gate, up, out, n);
  }
}

void silu_mul_row(const float* gate, const float* up, float* out, int64_t n, bool bf16) {
  bf16 ? silu_mul_on<true>(gate, up, out, n) : silu_mul_on<false>(gate, up, out, n);
}

void add_rows(float* x, const float* delta, int64_t n, bool bf16) {
  for (int64_t j = 0; j < n; ++j) {
    x[j] = bf16 ? casspec::round_bf16(x[j] + delta[j]) : x[j] + delta[j];
  }
}

void round_bf16(float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    x[j] = casspec::round_bf16(x[j]);
  }
}

void attend(const float* q, int64_t q_row, const float* keys, const float* values, int64_t kv_row, const bool* mask,
            int64_t T, int64_t end, int64_t r0, int64_t r1, int64_t G, int64_t hd, float scale, float* out,
            int64_t out_row) {
  casspec::attend(q, q_row, hd, keys, kv_row, values, kv_row, Visible{mask, T, end}, r0, r1, G, hd, scale, out,
                  out_row);
}

void attend(const float* q, int64_t q_row, const uint16_t* keys, const uint16_t* values, int64_t kv_row,
            const bool* mask, int64_t T, int64_t end, int64_t r0, int64_t r1, int64_t G, int64_t hd, float scale,
            float* out, int64_t out_row) {
  casspec::attend(q, q_row, hd, keys, kv_row, values, kv_row, Visible{mask, T, end}, r0, r1, G, hd, scale, out,
                  out_row);
}

}  // namespace raw

namespace {
// rows of `width` floats a thread's task of a row-wise op takes at least (a prompt's rows go to every thread; a
// step's few stay on one: waking the other costs more than they do)
int64_t rows_a_task(int64_t width) { return std::max<int64_t>(1, kPointwiseTask / std::max<int64_t>(1, width)); }
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  const int64_t T = x.size(0), D = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  check_norm(weight, D, eps, x.scalar_type(), "rms_norm weight (x's dtype)");
  const std::vector<float> w = widened(weight);
  at::Tensor out = x.new_empty({T, D});
  at::parallel_for(0, T, rows_a_task(D), [&](int64_t a, int64_t b) {
    Rows in(x, D), to(out, D);
    for (int64_t t = a; t < b; ++t) {
      raw::norm_row(in.read(t * x.stride(0), D), w.data(), to.target(t * D), D, eps, bf16);
      to.written(t * D, D);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows(x, "add_rms_norm x");
  check_rows(delta, "add_rms_norm delta");
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(), "casspec add_rms_norm: x ",
              x.sizes(), " and delta ", delta.sizes(), " must be of one shape and dtype");
  const int64_t T = x.size(0), D = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  check_norm(weight, D, eps, x.scalar_type(), "add_rms_norm weight (x's dtype)");
  const std::vector<float> w = widened(weight);
  at::Tensor sum = x.new_empty({T, D});
  at::Tensor out = x.new_empty({T, D});
  at::parallel_for(0, T, rows_a_task(D), [&](int64_t t0, int64_t t1) {
    Rows a(x, D), b(delta, D), s(sum, D), to(out, D);
    for (int64_t t = t0; t < t1; ++t) {
      float* st = s.target(t * D);
      std::memcpy(st, a.read(t * x.stride(0), D), sizeof(float) * D);
      raw::add_rows(st, b.read(t * delta.stride(0), D), D, bf16);
      raw::norm_row(st, w.data(), to.target(t * D), D, eps, bf16);
      s.written(t * D, D);
      to.written(t * D, D);
    }
  });
  return {sum, out};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "casspec rope: float32 or bfloat16 x expected, got ",
              c10::toString(dtype));
  check_tensor(x, "rope x [heads, T, hd]", dtype, 3);
  const int64_t H = x.size(0), T = x.size(1), hd = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 || hd <= 1, "casspec rope: x [heads, T, hd] with unit stride");
  TORCH_CHECK(hd % 2 == 0, "casspec rope: an even head size expected, got ", hd);
  check_tensor(cos, "rope cos [T, hd] (x's dtype)", dtype, 2);
  check_tensor(sin, "rope sin [T, hd] (x's dtype)", dtype, 2);
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == hd && sin.sizes() == cos.sizes(), "casspec rope: cos and sin [", T,
              ", ", hd, "] expected (x's positions and head size), got ", cos.sizes(), " and ", sin.sizes());
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();  // (widened: exact)
  at::Tensor out = x.new_empty({H, T, hd});
  const bool bf16 = dtype == at::kBFloat16;
  at::parallel_for(0, T, rows_a_task(H * hd), [&](int64_t t0, int64_t t1) {
    Rows in(x, hd), to(out, hd);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t o = (h * T + t) * hd;
        raw::rope_row(in.read(h * x.stride(0) + t * x.stride(1), hd), c.data_ptr<float>() + t * hd,
                      s.data_ptr<float>() + t * hd, to.target(o), hd, bf16);
        to.written(o, hd);
      }
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "silu_mul gate");
  check_rows(up, "silu_mul up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "casspec silu_mul: gate ",
              gate.sizes(), " and up ", up.sizes(), " must be of one shape and dtype");
  const int64_t T = gate.size(0), I = gate.size(1);
  const bool bf16 = gate.scalar_type() == at::kBFloat16;
  at::Tensor out = gate.new_empty({T, I});
  at::parallel_for(0, T, rows_a_task(I), [&](int64_t a, int64_t b) {
    Rows g(gate, I), u(up, I), to(out, I);
    for (int64_t t = a; t < b; ++t) {
      const float* gt = g.read(t * gate.stride(0), I);
      raw::silu_mul_row(gt, u.read(t * up.stride(0), I), to.target(t * I), I, bf16);
      to.written(t * I, I);
    }
  });
  return out;
}

at::Tensor visible_mask(const std::optional<at::Tensor>& mask, int64_t T, int64_t end, const char* what) {
  if (!mask) {
    return at::Tensor();
  }
  TORCH_CHECK(mask->defined() && mask->device().is_cpu() && mask->dim() == 2 && mask->size(0) == T &&
                  mask->size(1) == end,
              what, ": mask [", T, ", ", end, "] on the CPU expected, got ",
              mask->defined() ? mask->sizes() : at::IntArrayRef{});
  at::Tensor m = mask->to(at::kBool).contiguous();
  const bool* rows = m.data_ptr<bool>();
  for (int64_t t = 0; t < T; ++t) {  // (a row that sees no key has no softmax)
    TORCH_CHECK(std::find(rows + t * end, rows + (t + 1) * end, true) != rows + (t + 1) * end, what,
                ": query row ", t, " of the mask sees no key");
  }
  return m;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t end,
                     const std::optional<at::Tensor>& mask, double scale) {
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "casspec attention: float32 or bfloat16 q expected, got ",
              c10::toString(dtype));
  check_tensor(q, "attention q [H, T, hd]", dtype, 3);
  check_tensor(keys, "attention keys [Hkv, S, hd] (q's dtype)", dtype, 3);
  check_tensor(values, "attention values [Hkv, S, hd] (q's dtype)", dtype, 3);
  const int64_t H = q.size(0), T = q.size(1), hd = q.size(2), Hkv = keys.size(0);
  TORCH_CHECK(H >= 1 && Hkv >= 1 && H % Hkv == 0, "casspec attention: ", H, " query heads over ", Hkv,
              " KV heads (at least one each, the query heads a multiple of the KV heads)");
  TORCH_CHECK(hd >= 1 && hd <= kMaxHeadDim, "casspec attention: head size 1..", kMaxHeadDim, " expected, got ", hd);
  TORCH_CHECK(keys.size(2) == hd && values.sizes() == keys.sizes(), "casspec attention: keys and values [", Hkv,
              ", S, ", hd, "] expected, got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1,
              "casspec attention: q, keys and values with unit stride over the head");
  TORCH_CHECK(end >= T && end <= keys.size(1), "casspec attention: end ", end, " must cover the ", T,
              " query rows and lie within the ", keys.size(1), " slots");
  TORCH_CHECK(std::isfinite(scale), "casspec attention: a finite scale expected, got ", scale);
  const at::Tensor m = visible_mask(mask, T, end, "casspec attention");
  const at::Tensor qf = q.to(at::kFloat);  // (bfloat16 to float32 is exact; a float32 q is itself)
  at::Tensor out = qf.new_empty({T, H * hd});  // [T, H*hd]: the output projection's input
  const int64_t G = H / Hkv;
  const Visible seen{m.defined() ? m.data_ptr<bool>() : nullptr, T, end};
  const int64_t blocks = (T + kRowBlock - 1) / kRowBlock, items = Hkv * blocks;  // (KV head, block of rows)
  const int64_t work = T * H * end * hd;  // multiply-adds of the scores (at most)
  const int64_t grain = work > kParallelWork ? 1 : std::max<int64_t>(1, items);  // (small ones on one thread)
  // the items taken from both ends in turn (a block of later rows sees more keys: threads given runs of them in
  // order, the one with the last rows did three quarters of a prompt's attention while the other waited)
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t stop) {
    for (int64_t i = begin; i < stop; ++i) {
      const int64_t item = i % 2 == 0 ? i / 2 : items - 1 - i / 2;
      const int64_t g = item % Hkv, r0 = item / Hkv * kRowBlock;
      const float* qg = qf.data_ptr<float>() + g * G * qf.stride(0);
      const int64_t r1 = std::min(T, r0 + kRowBlock);
      float* o = out.data_ptr<float>() + g * G * hd;
      if (dtype == at::kFloat) {
        attend(qg, qf.stride(1), qf.stride(0), keys.data_ptr<float>() + g * keys.stride(0), keys.stride(1),
               values.data_ptr<float>() + g * values.stride(0), values.stride(1), seen, r0, r1, G, hd,
               static_cast<float>(scale), o, H * hd);
      } else {
        attend(qg, qf.stride(1), qf.stride(0),
               reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()) + g * keys.stride(0), keys.stride(1),
               reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()) + g * values.stride(0),
               values.stride(1), seen, r0, r1, G, hd, static_cast<float>(scale), o, H * hd);
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace casspec
