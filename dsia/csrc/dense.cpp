// A dense float32 or bfloat16 product on the CPU (torch.ops.casspec.dense_linear): y [T, N] = x [T, K] @ w [N, K]^T
// (+ bias), casspec's own, so that its bits do not rest on what a vendor kernel happens to do on the CPU at hand.
//
// Each output's sum runs in 16 lanes: lane l takes inputs k = 16 c + l for c = 0, 1, ... in order, one fused
// multiply-add each (inputs past K are zeros), then the lanes are folded in halves (l + l+8, + 4, + 2, + 1) and the
// bias added. That sequence is the same whatever the call's row count, whichever rows sit beside a row and however
// the outputs are split between threads, so a row's result is the same bits in a one-token step and in a tree's
// verification (batch-invariant by construction). The AVX-512, AVX2 and plain loops run the same lane operations
// (a fused multiply-add is exact before its one rounding, so std::fma gives the instructions' bits), so a row's
// result is also the same on every machine. The loops share their tiling code (dense_rows.h, included once per
// instruction set): a tile of O outputs by R rows loads each 16-input chunk of its weights once for its R rows, and
// its next rows find them in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "fold512.h"
#include "ops.h"

namespace casspec {
namespace {
constexpr int64_t kLanes = 16;
constexpr int64_t kAheadBytes = 8192;  // a tile's first rows prefetch the weights this far ahead (the tile's own at
// one output a tile were too near: 1.2x the bandwidth floor in float32 against 1.3x, bfloat16 1.2x against 1.5x)

// a call's operands, all float32 or all bfloat16 (Wt float, or uint16_t: bfloat16's bits)
template <class Wt>
struct Job {
  const Wt* x;  // [T, K]
  const Wt* w;  // [N, K]
  const Wt* bias;  // [N] or nullptr
  Wt* y;  // [T, N], rows ldy apart
  int64_t T, K, N, ldy;
};

// a value as float32 (bfloat16's bits widened exactly), and a float32 sum in the output's type (bfloat16: rounded to
// nearest even, as torch rounds)
inline float widen(float v) { return v; }
inline float widen(uint16_t bits) { return c10::detail::f32_from_bits(bits); }
template <class Wt>
inline Wt narrow(float v) {
  if constexpr (std::is_same_v<Wt, float>) {
    return v;
  } else {
    return c10::BFloat16(v).x;
  }
}

// the 16 lanes' sum, folded in halves (lane i + lane i + 8, then + 4, + 2, + 1): the same order in every path
inline float fold16(const float* v) {
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}
}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace dense512 {
namespace {
struct Vec {
  __m512 v;
  [[gnu::always_inline]] static Vec zero() { return {_mm512_setzero_ps()}; }
  [[gnu::always_inline]] static Vec load(const float* p, int64_t n) {
    return {n == kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
  }
  [[gnu::always_inline]] static Vec load(const uint16_t* p, int64_t n) {  // bfloat16 bits, widened exactly
    alignas(32) uint16_t t[kLanes] = {};
    if (n < kLanes) {
      std::memcpy(t, p, sizeof(uint16_t) * n);
      p = t;
    }
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  [[gnu::always_inline]] static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  [[gnu::always_inline]] void store(float* p) const { _mm512_storeu_ps(p, v); }
  [[gnu::always_inline]] float fold() const {  // fold16's additions: l + l+8, + 4, + 2, + 1
    __m512 a = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));  // 256-bit halves swapped
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xB1));  // 128-bit quarters swapped in pairs
    a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4E));  // (l, l+2)
    a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));  // (l, l+1)
    return _mm512_cvtss_f32(a);
  }
};
// the folds of 16 vectors at once (out[s] = fold16 of v[s]: fold512.h)
[[gnu::always_inline]] inline void fold_many(const Vec* v, float* out) {
  __m512 w[16];
  for (int i = 0; i < 16; ++i) {
    w[i] = v[i].v;
  }
  _mm512_storeu_ps(out, fold16x16(w));
}
#include "dense_rows.h"
// One row to 4: one output a tile, so each thread reads its weights as one stream (at the bandwidth floor); more
// rows: 4 outputs by 6 rows a tile share each row's loads (28 of the 32 registers), 16 of its 24 sums folded
// together and 8 one by one in registers (Vec::fold; when those 8 called the baseline fold, 4 x 4 tiles were
// faster: SmolLM2's 16-row products 18.3 -> 16.6 ms; now 4 x 6 is 3-4% ahead of 4 x 4, AMD EPYC, alternated runs)
template <class Wt>
void range(const Job<Wt>& j, int64_t a, int64_t b) {
  if (j.T <= 4) {
    tiles<1, 4>(j, a, b);
  } else {
    tiles<4, 6>(j, a, b);
  }
}
}  // namespace
}  // namespace dense512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace dense256 {
namespace {
struct Vec {
  __m256 lo, hi;
  [[gnu::always_inline]] static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  [[gnu::always_inline]] static Vec load(const float* p, int64_t n) {
    if (n == kLanes) {
      return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    }
    alignas(32) float t[16] = {};
    std::memcpy(t, p, sizeof(float) * n);
    return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
  }
  [[gnu::always_inline]] static Vec load(const uint16_t* p, int64_t n) {  // bfloat16 bits, widened exactly
    alignas(32) uint16_t t[kLanes] = {};
    if (n < kLanes) {
      std::memcpy(t, p, sizeof(uint16_t) * n);
      p = t;
    }
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
  }
  [[gnu::always_inline]] static Vec fma(Vec a, Vec b, Vec c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  [[gnu::always_inline]] void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  [[gnu::always_inline]] float fold() const {  // fold16's additions: l + l+8, + 4, + 2, + 1
    __m256 a = _mm256_add_ps(lo, hi);
    a = _mm256_add_ps(a, _mm256_permute2f128_ps(a, a, 0x01));  // 128-bit halves swapped
    a = _mm256_add_ps(a, _mm256_permute_ps(a, 0x4E));
    a = _mm256_add_ps(a, _mm256_permute_ps(a, 0xB1));
    return _mm256_cvtss_f32(a);
  }
};
#include "dense_rows.h"
// 16 registers: one output by 4 rows, or 2 by 2
template <class Wt>
void range(const Job<Wt>& j, int64_t a, int64_t b) {
  if (j.T <= 4) {
    tiles<1, 4>(j, a, b);
  } else {
    tiles<2, 2>(j, a, b);
  }
}
}  // namespace
}  // namespace dense256
#pragma GCC pop_options

namespace dense_plain {
namespace {
struct Vec {
  float v[kLanes];
  static Vec zero() { return Vec{}; }
  static Vec load(const float* p, int64_t n) {
    Vec r{};
    std::memcpy(r.v, p, sizeof(float) * n);
    return r;
  }
  static Vec load(const uint16_t* p, int64_t n) {  // bfloat16 bits, widened exactly
    Vec r{};
    for (int64_t i = 0; i < n; ++i) r.v[i] = widen(p[i]);
    return r;
  }
  static Vec fma(const Vec& a, const Vec& b, const Vec& c) {
    Vec r;
    for (int64_t i = 0; i < kLanes; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  float fold() const { return fold16(v); }
};
#include "dense_rows.h"
template <class Wt>
void range(const Job<Wt>& j, int64_t a, int64_t b) { tiles<1, 1>(j, a, b); }
}  // namespace
}  // namespace dense_plain

namespace {
constexpr int64_t kTaskOutputs = 16;  // outputs a thread's task takes at least

// outputs [lo, hi) of every row of the job, by the loop of instruction set `isa`
template <class Wt>
void range_on(const Job<Wt>& j, int64_t lo, int64_t hi, Isa isa) {
  if (isa == kAvx512) {
    dense512::range(j, lo, hi);
  } else if (isa == kAvx2) {
    dense256::range(j, lo, hi);
  } else {
    dense_plain::range(j, lo, hi);
  }
}
}  // namespace

void raw::dense_range(const float* x, const float* w, const float* bias, float* y, int64_t ldy, int64_t T, int64_t K,
                      int64_t lo, int64_t hi, Isa isa) {
  range_on(Job<float>{x, w, bias, y, T, K, hi, ldy}, lo, hi, isa);  // (outputs past hi are not read)
}

// x [T, K] and w [N, K] contiguous, both float32 or both bfloat16, bias [N] in their dtype or none; isa: -1 the best
// this CPU has, else 0 plain, 1 AVX2, 2 AVX-512 (tests). -> [T, N] in x's dtype: bfloat16 inputs are widened exactly
// and summed in float32 as float32 ones are, the sums rounded to bfloat16 once, at the end.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t isa) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "casspec dense_linear: float32 or bfloat16 x expected, "
              "got ", c10::toString(dtype));
  check_tensor(x, "dense_linear x [T, K]", dtype, 2);
  check_tensor(w, "dense_linear w [N, K] (x's dtype)", dtype, 2);
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && w.is_contiguous(), "casspec dense_linear: w [N, ", K, "] contiguous expected, got ",
              w.sizes());
  if (bias) {
    check_tensor(*bias, "dense_linear bias [N] (x's dtype)", dtype, 1);
    TORCH_CHECK(bias->size(0) == N && bias->is_contiguous(), "casspec dense_linear: bias of ", N,
                " values expected, got ", bias->sizes());
  }
  TORCH_CHECK(isa >= kAuto && isa <= machine_isa(), "casspec dense_linear: isa ", isa,
              " is not one this CPU runs (or CASSPEC_ISA allows): -1 the best, 0 plain, 1 AVX2, 2 AVX-512");
  const Isa use = isa == kAuto ? machine_isa() : static_cast<Isa>(isa);
  const at::Tensor xc = x.contiguous();
  const std::optional<at::Tensor> bc = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  at::Tensor y = at::empty({T, N}, xc.options());
  const int64_t tasks = (N + kTaskOutputs - 1) / kTaskOutputs;
  const int64_t work = std::max<int64_t>(1, T * K * kTaskOutputs);  // multiply-adds of a task
  const int64_t grain = std::max<int64_t>(1, kParallelWork / work);
  auto run = [&](const auto& j) {
    at::parallel_for(0, tasks, grain, [&](int64_t a, int64_t b) {
      range_on(j, a * kTaskOutputs, std::min(N, b * kTaskOutputs), use);
    });
  };
  if (dtype == at::kFloat) {
    run(Job<float>{xc.data_ptr<float>(), w.data_ptr<float>(), bc ? bc->data_ptr<float>() : nullptr,
                   y.data_ptr<float>(), T, K, N, N});
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run(Job<uint16_t>{bits(xc), bits(w), bc ? bits(*bc) : nullptr, bits(y), T, K, N, N});
  }
  return y;
}

}  // namespace casspec

TORCH_LIBRARY_FRAGMENT(casspec, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias=None, int isa=-1) -> Tensor", &casspec::dense_linear);
}
