// Position-owned Gumbel noise for sampling (torch.ops.casspec.gumbel; dytc/verify.py's `Noise`): g = -log(-log u) for
// each token of the vocabulary at one sequence position, u a uniform drawn by a counter-based generator, so that any
// token's value is a pure function of (seed, position, token) and costs the same alone as in its whole row. A
// sampler reads the noise of the few tokens it can pick (top-p's nucleus, a draft's candidates): 1-3 us where a whole
// row of 49k from torch's generator cost 270 us on a 2-core AMD EPYC (a whole row here: 90 us).
//
// u: SplitMix64's output function over the counter stream + (token + 1) * golden, the stream mixed from the seed
// and the position; its top 52 bits, plus a half, times 2^-52: in [2^-53, 1 - 2^-53], never 0 or 1. log: x = 2^k m
// with m in [sqrt(1/2), sqrt(2)) (musl's bit split), log m = 2 atanh(s), s = (m - 1) / (m + 1), by its series to
// s^21 (|s| <= 0.1716: within 2^-52 of log m), k ln 2 in two parts. Eight lanes of the same operations, lane by lane
// independent: a token's value is the same bits in any call and on every instruction set's path.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <bit>

#include <cstring>

namespace casspec {
namespace {

typedef double v8d __attribute__((vector_size(64), aligned(8)));  // 8 doubles, unaligned loads and stores
typedef uint64_t u64x8 __attribute__((vector_size(64), aligned(8)));
typedef int64_t i64x8 __attribute__((vector_size(64), aligned(8)));
constexpr int64_t kLanes = 8;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;  // SplitMix64's increment (2^64 / the golden ratio)
constexpr int64_t kParallelTokens = 1 << 14;  // a call for more tokens than this runs on every thread

// SplitMix64's output function (Steele, Lea, Flood 2014) in every lane
template <typename U>
[[gnu::always_inline]] inline U mix(U z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// log x in every lane, x positive, normal and finite
[[gnu::always_inline]] inline v8d vlog(v8d x) {
  const u64x8 bits = std::bit_cast<u64x8>(x);
  const u64x8 off = bits - 0x3FE6A09E667F3BCDULL;  // (musl's log: the exponent k counted from sqrt(1/2))
  const i64x8 k = std::bit_cast<i64x8>(off) >> 52;
  const v8d m = std::bit_cast<v8d>(bits - (off & (0xFFFULL << 52)));  // m = x / 2^k in [sqrt(1/2), sqrt(2))
  const v8d s = (m - 1.0) / (m + 1.0), z = s * s;
  v8d p = v8d{} + 2.0 / 21;
  for (const double c : {2.0 / 19, 2.0 / 17, 2.0 / 15, 2.0 / 13, 2.0 / 11, 2.0 / 9, 2.0 / 7, 2.0 / 5, 2.0 / 3, 2.0}) {
    p = p * z + c;
  }
  const v8d kd = std::bit_cast<v8d>(std::bit_cast<u64x8>(k) + 0x4338000000000000ULL) - 0x1.8p52;  // k exactly (a
  // small integer under 1.5 * 2^52's bits: no 64-bit integer conversion needs AVX512DQ)
  return kd * 6.93147180369123816490e-01 + (s * p + kd * 1.90821492927058770002e-10);  // (ln 2, hi + lo)
}

// the noise of tokens [n] (tokens null: first..first+n-1) of the stream into out [n]
[[gnu::always_inline]] inline void gumbel_impl(uint64_t stream, const int64_t* tokens, int64_t first, int64_t n,
                                               double* out) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t w = std::min(kLanes, n - j);
    u64x8 t = {};
    for (int64_t l = 0; l < w; ++l) {  // (lanes past n: token 0's, not stored)
      t[l] = static_cast<uint64_t>(tokens == nullptr ? first + j + l : tokens[j + l]);
    }
    const u64x8 r = mix(stream + (t + 1) * kGolden);
    const v8d top = std::bit_cast<v8d>((r >> 12) | 0x4330000000000000ULL) - 0x1.0p52;  // r's top 52 bits, exactly
    const v8d u = (top + 0.5) * 0x1.0p-52;
    const v8d g = -vlog(-vlog(u));
    std::memcpy(out + j, &g, sizeof(double) * w);
  }
}
#define CASSPEC_GUMBEL_ARGS uint64_t s, const int64_t *t, int64_t f, int64_t n, double *o
void gumbel_plain(CASSPEC_GUMBEL_ARGS) { gumbel_impl(s, t, f, n, o); }
__attribute__((target("avx2"))) void gumbel_avx2(CASSPEC_GUMBEL_ARGS) { gumbel_impl(s, t, f, n, o); }
__attribute__((target("avx512f"))) void gumbel_avx512(CASSPEC_GUMBEL_ARGS) { gumbel_impl(s, t, f, n, o); }

// the stream of one (seed, position): each token's counter is stream + (token + 1) * golden
uint64_t stream_of(int64_t seed, int64_t position) {
  return mix(mix(static_cast<uint64_t>(seed)) + static_cast<uint64_t>(position) * kGolden);
}

// the widest instruction set's drawing function
auto path() { return machine_isa() == kAvx512 ? gumbel_avx512 : machine_isa() == kAvx2 ? gumbel_avx2 : gumbel_plain; }

}  // namespace

void gumbel_tokens(int64_t seed, int64_t position, const int64_t* tokens, int64_t n, double* out) {
  path()(stream_of(seed, position), tokens, 0, n, out);
}

at::Tensor gumbel(int64_t seed, int64_t position, const std::optional<at::Tensor>& tokens, int64_t vocab) {
  TORCH_CHECK(vocab >= 1, "casspec gumbel: a vocabulary of at least one token expected, got ", vocab);
  TORCH_CHECK(position >= 0, "casspec gumbel: a position >= 0 expected, got ", position);
  at::Tensor t;
  if (tokens.has_value()) {
    check_tensor(*tokens, "gumbel tokens [n]", at::kLong, 1);
    t = tokens->contiguous();
    const int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      TORCH_CHECK(p[i] >= 0 && p[i] < vocab, "casspec gumbel: tokens must lie in 0..", vocab - 1, ", got ", p[i]);
    }
  }
  const int64_t n = t.defined() ? t.numel() : vocab;
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  const uint64_t stream = stream_of(seed, position);
  const int64_t* tp = t.defined() ? t.data_ptr<int64_t>() : nullptr;
  double* op = out.data_ptr<double>();
  const auto run = path();
  const int64_t chunks = (n + kLanes - 1) / kLanes;  // (threads take whole chunks of 8: the same lanes as alone)
  at::parallel_for(0, chunks, n > kParallelTokens ? 1 : chunks, [&](int64_t c0, int64_t c1) {
    const int64_t j0 = c0 * kLanes, count = std::min(n, c1 * kLanes) - j0;
    run(stream, tp == nullptr ? nullptr : tp + j0, j0, count, op + j0);
  });
  return out;
}

}  // namespace casspec
