// A dense float32 or bfloat16 product on the CPU (torch.ops.casspec.dense_panels): y [T, N] = x [T, K] @ w [N, K]^T
// (+ bias), casspec's own, so that its bits do not rest on what a vendor kernel happens to do on the CPU at hand.
//
// The weights are read as panels (dense_pack, once per weight): group g holds outputs [64 g, 64 g + 64) as [K][64]
// (zeros past N), so one 16-lane load is one input of 16 outputs, and a group is one stream from memory. Output n of
// a row starts at zero and takes inputs k = 0, 1, ..., K - 1 in order, one fused multiply-add each, then the bias.
// That sequence is the same whatever the call's row count, whichever rows sit beside a row and however the panels
// are split between threads, so a row's result is the same bits in a one-token step and in a tree's verification
// (batch-invariant by construction). The AVX-512, AVX2 and plain loops run the same operations per output (a fused
// multiply-add is exact before its one rounding, so std::fma gives the instructions' bits), so a row's result is
// also the same on every machine. The loops share their tiling code (dense_rows.h, included once per instruction
// set): a tile of O vectors of a group by R rows loads each weight once for its R rows (outer products: no sum is
// folded across lanes, so a tile runs at the multiply-add units' rate), its next rows find the group in the cache,
// and memory streams the next group meanwhile.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "ops.h"

namespace casspec {
namespace {
constexpr int64_t kLanes = 16;  // outputs a vector
constexpr int64_t kGroup = kDenseGroup;
constexpr int64_t kAheadBytes = 8192;  // a group swept once (up to 6 rows) prefetches its stream this far ahead (as
// the row-major kernel before it found best: 1.2x the bandwidth floor in float32 against 1.3x)

// a call's operands: x widened to float32; the panels, the bias and the output all float32 or all bfloat16 (Wt
// float, or uint16_t: bfloat16's bits)
template <class Wt>
struct Job {
  const float* x;  // [T, K]
  const Wt* w;  // panels [ceil(N / 64), K, 64]
  const Wt* bias;  // [N] or nullptr
  Wt* y;  // [T, N], rows ldy apart
  int64_t T, K, N, ldy;
  float* yf = nullptr;  // or here, in place of y (bfloat16 panels, no bias): each sum rounded to bfloat16, as float32
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
}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace dense512 {
namespace {
struct Vec {
  __m512 v;
  [[gnu::always_inline]] static Vec zero() { return {_mm512_setzero_ps()}; }
  [[gnu::always_inline]] static Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  [[gnu::always_inline]] static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  [[gnu::always_inline]] static Vec load(const uint16_t* p) {  // bfloat16 bits, widened exactly
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  [[gnu::always_inline]] static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  [[gnu::always_inline]] void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#include "dense_rows.h"
// 32 registers: a group's 4 vectors by up to 6 rows (24 sums), the rows' broadcast inputs and a weight
template <class Wt>
void range(const Job<Wt>& j, int64_t a, int64_t b) { tiles<4, 6>(j, a, b); }
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
  [[gnu::always_inline]] static Vec broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  [[gnu::always_inline]] static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  [[gnu::always_inline]] static Vec load(const uint16_t* p) {  // bfloat16 bits, widened exactly
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
};
#include "dense_rows.h"
// 16 registers, two a Vec: half a group by up to 3 rows (12 for the sums)
template <class Wt>
void range(const Job<Wt>& j, int64_t a, int64_t b) { tiles<2, 3>(j, a, b); }
}  // namespace
}  // namespace dense256
#pragma GCC pop_options

namespace dense_plain {
namespace {
struct Vec {
  float v[kLanes];
  static Vec zero() { return Vec{}; }
  static Vec broadcast(float x) {
    Vec r;
    for (int64_t i = 0; i < kLanes; ++i) r.v[i] = x;
    return r;
  }
  static Vec load(const float* p) {
    Vec r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static Vec load(const uint16_t* p) {  // bfloat16 bits, widened exactly
    Vec r;
    for (int64_t i = 0; i < kLanes; ++i) r.v[i] = widen(p[i]);
    return r;
  }
  static Vec fma(const Vec& a, const Vec& b, const Vec& c) {
    Vec r;
    for (int64_t i = 0; i < kLanes; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
};
#include "dense_rows.h"
template <class Wt>
void range(const Job<Wt>& j, int64_t a, int64_t b) { tiles<1, 1>(j, a, b); }
}  // namespace
}  // namespace dense_plain

namespace {
// halves [a, b) of the groups (32 outputs each) of every row of the job, by the loop of instruction set `isa`
template <class Wt>
void range_on(const Job<Wt>& j, int64_t a, int64_t b, Isa isa) {
  if (isa == kAvx512) {
    dense512::range(j, a, b);
  } else if (isa == kAvx2) {
    dense256::range(j, a, b);
  } else {
    dense_plain::range(j, a, b);
  }
}

int64_t groups_of(int64_t n) { return (n + kGroup - 1) / kGroup; }
int64_t halves_of(int64_t n) { return (n + kGroup / 2 - 1) / (kGroup / 2); }

// checked operands of a product with panels [G, K, 64] of N outputs: (x contiguous, bias contiguous)
std::tuple<at::Tensor, std::optional<at::Tensor>> checked(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                                                         const std::optional<at::Tensor>& bias, int64_t isa) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "casspec dense_panels: float32 or bfloat16 x expected, "
              "got ", c10::toString(dtype));
  check_tensor(x, "dense_panels x [T, K]", dtype, 2);
  check_panels(panels, N, x.size(1), dtype, "dense_panels");
  if (bias) {
    check_tensor(*bias, "dense_panels bias [N] (x's dtype)", dtype, 1);
    TORCH_CHECK(bias->size(0) == N, "casspec dense_panels: bias of ", N, " values expected, got ", bias->sizes());
  }
  TORCH_CHECK(isa >= kAuto && isa <= machine_isa(), "casspec dense_panels: isa ", isa,
              " is not one this CPU runs (or CASSPEC_ISA allows): -1 the best, 0 plain, 1 AVX2, 2 AVX-512");
  return {x.contiguous(), bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt};
}
}  // namespace

void check_panels(const at::Tensor& panels, int64_t N, int64_t K, at::ScalarType dtype, const char* what) {
  check_tensor(panels, what, dtype, 3);
  TORCH_CHECK(N >= 0 && panels.size(0) == groups_of(N) && panels.size(1) == K && panels.size(2) == kGroup &&
                  panels.is_contiguous(),
              "casspec ", what, ": panels [", groups_of(N), ", ", K, ", 64] contiguous expected (dense_pack of a w [",
              N, ", ", K, "]), got ", panels.sizes());
}

void raw::dense_range(const float* x, const float* panels, const float* bias, float* y, int64_t ldy, int64_t T,
                      int64_t K, int64_t lo, int64_t hi, Isa isa) {
  // (outputs past hi are not written: the job's N is hi, and half lo / 32 starts at output lo)
  range_on(Job<float>{x, panels, bias, y, T, K, hi, ldy}, lo / (kGroup / 2), halves_of(hi), isa);
}

void raw::dense_range(const float* x, const uint16_t* panels, float* y, int64_t ldy, int64_t T, int64_t K, int64_t lo,
                      int64_t hi, Isa isa) {
  range_on(Job<uint16_t>{x, panels, nullptr, nullptr, T, K, hi, ldy, y}, lo / (kGroup / 2), halves_of(hi), isa);
}

// w [N, K], float32 or bfloat16 -> its panels [ceil(N / 64), K, 64] in its dtype, zeros past N
at::Tensor dense_pack(const at::Tensor& w) {
  const at::ScalarType dtype = w.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "casspec dense_pack: float32 or bfloat16 w expected, "
              "got ", c10::toString(dtype));
  check_tensor(w, "dense_pack w [N, K]", dtype, 2);
  const int64_t N = w.size(0), K = w.size(1), P = groups_of(N);
  // [N, K] padded with zero rows to [P * 64, K], each group's [64, K] transposed to [K, 64]
  at::Tensor padded = w.new_zeros({P * kGroup, K});
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kGroup, K}).transpose(1, 2).contiguous();
}

// x [T, K] and panels [ceil(N / 64), K, 64] (dense_pack of w [N, K]), both float32 or both bfloat16, bias [N] in
// their dtype or none; isa: -1 the best this CPU has, else 0 plain, 1 AVX2, 2 AVX-512 (tests). -> [T, N] in x's
// dtype: bfloat16 inputs are widened exactly and summed in float32 as float32 ones are, the sums rounded to
// bfloat16 once, at the end.
at::Tensor dense_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const std::optional<at::Tensor>& bias, int64_t isa) {
  auto [xc, bc] = checked(x, panels, N, bias, isa);
  const Isa use = isa == kAuto ? machine_isa() : static_cast<Isa>(isa);
  const int64_t T = xc.size(0), K = xc.size(1), P = halves_of(N);
  const at::Tensor xf = xc.scalar_type() == at::kFloat ? xc : xc.to(at::kFloat);  // (bfloat16 widened: exact)
  at::Tensor y = xc.new_empty({T, N});
  const int64_t work = std::max<int64_t>(1, T * K * kGroup / 2);  // multiply-adds of a half group
  const int64_t grain = std::max<int64_t>(1, kParallelWork / work);
  auto run = [&](const auto& j) {
    at::parallel_for(0, P, grain, [&](int64_t a, int64_t b) { range_on(j, a, b, use); });
  };
  if (xc.scalar_type() == at::kFloat) {
    run(Job<float>{xf.data_ptr<float>(), panels.data_ptr<float>(), bc ? bc->data_ptr<float>() : nullptr,
                   y.data_ptr<float>(), T, K, N, N});
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run(Job<uint16_t>{xf.data_ptr<float>(), bits(panels), bc ? bits(*bc) : nullptr, bits(y), T, K, N, N});
  }
  return y;
}

// the same product of w [N, K] as it is (packed for this call: tests, and products of weights no caller keeps)
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "casspec dense_linear: float32 or "
              "bfloat16 x expected, got ", c10::toString(x.scalar_type()));
  check_tensor(w, "dense_linear w [N, K] (x's dtype)", x.scalar_type(), 2);
  TORCH_CHECK(w.size(1) == x.size(-1), "casspec dense_linear: w [N, ", x.size(-1), "] expected, got ", w.sizes());
  return dense_panels(x, dense_pack(w), w.size(0), bias, isa);
}

}  // namespace casspec
