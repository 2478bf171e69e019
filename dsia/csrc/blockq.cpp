// A GGUF-style block-quantized product on the CPU (torch.ops.casspec.block_linear): weights in blocks of 32 with a
// scale d (and an offset m, Q4_1) per block, as stored (4-bit codes 0..15 or 8-bit codes), times the activations
// quantized per row and block to 8 bits (dx per block, as llama.cpp's Q8 activations): integer dot products, then
// y[t, o] = sum over blocks of d * dx * (codes . xq) + m * dx * sum(xq), each block's two terms fused
// multiply-adds into one accumulator in block order (acc = fma(codes . xq, d * dx, acc); acc = fma(m, sx, acc)).
//
// Outputs go 16 at a time, one per float lane (dsia/blockq.py lays the codes out so: per tile of 16 outputs and
// block, 8 groups of 4 inputs, each group's 4 bytes for every output side by side), so nothing is summed across
// lanes; a tile's unpacked block is shared by up to 8 rows. Every row is computed by the same operations in the same
// order whatever the rows beside it: integer sums are exact, and each lane sums its blocks in order. The AVX-512
// VNNI, AVX2 and plain loops compute the same lanes, so a row's result is the same bits on every machine and in
// every call (batch-invariant by construction).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace casspec {
namespace {

constexpr int64_t kBlock = raw::kBlockInputs;  // weights per block (32)
constexpr int64_t kTile = 16;  // outputs per tile, one per float lane
constexpr int64_t kGroups = kBlock / 4;  // groups of 4 inputs per block (a 32-bit lane's 4 bytes)
constexpr int64_t kAheadBytes = 8192;  // how far ahead in the codes (and as many blocks ahead in the scales) a tile's
// loop prefetches: the native SmolLM2 step's 121 products took 3.3-3.4 ms with it against 3.5-4.0 without (AMD EPYC)
constexpr int kRowTile = 8;  // rows that share each unpacked block on AVX-512 (AVX2's 16 registers: 4)

// A call's operands. codes per (tile, block): 8-bit: 8 groups x 16 outputs x 4 bytes, each code + 128 (0..255);
// 4-bit: 4 x 16 x 4 bytes, group g in the low nibbles and group g + 4 in the high ones. d, m: [tiles, blocks, 16].
// Activations: xq [T, K] int8, dx, sx [T, blocks] (sx = dx * sum of the block's xq), xsum [T, blocks] (that sum).
struct Call {
  const uint8_t* codes;
  bool eight;  // 8-bit codes, else 4-bit
  const uint16_t* d;  // float16 bits (as GGUF stores a block's scales; widened exactly)
  const uint16_t* m;  // or nullptr (no offsets)
  const int8_t* xq;
  const float* dx;
  const float* sx;
  const int32_t* xsum;
  float* out;  // [T, N], rows ldo apart
  int64_t N, T, K, blocks, ldo;
};

inline int64_t code_bytes(const Call& c) { return c.eight ? kGroups * kTile * 4 : kGroups / 2 * kTile * 4; }

// prefetch the codes and scales kAheadBytes of codes past block b of `tile` (tiles lie one after another, so past a
// tile's last block come the next tile's first), where that lies within the weight
[[gnu::always_inline]] inline void prefetch_ahead(const Call& c, int64_t tile, int64_t b) {
  const int64_t bytes = code_bytes(c), blocks = kAheadBytes / bytes, at = tile * c.blocks + b + blocks;
  if (at >= (c.N + kTile - 1) / kTile * c.blocks) {
    return;
  }
  for (int64_t line = 0; line < bytes; line += 64) {
    __builtin_prefetch(c.codes + at * bytes + line, 0, 3);
  }
  __builtin_prefetch(c.d + at * kTile, 0, 3);
  if (c.m != nullptr) {
    __builtin_prefetch(c.m + at * kTile, 0, 3);
  }
}

// a float16's bits widened to float32 (exactly), plain; and 8 or 16 of them at once
inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

__attribute__((target("avx2,f16c"), always_inline)) inline __m256 load8_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx512f"), always_inline)) inline __m512 load16_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// the 8-bit code of output lane `lane`, input 4 g + j of block b of tile `tile` (signed), plain
inline int32_t code_plain(const Call& c, int64_t tile, int64_t b, int64_t g, int64_t lane, int64_t j) {
  const uint8_t* w = c.codes + (tile * c.blocks + b) * code_bytes(c);
  if (c.eight) {
    return int32_t{w[(g * kTile + lane) * 4 + j]} - 128;
  }
  const uint8_t byte = w[((g % 4) * kTile + lane) * 4 + j];
  return g < 4 ? byte & 15 : byte >> 4;
}

template <int R>
[[gnu::always_inline]] inline void rows_plain(const Call& c, int64_t tile, int64_t t0) {
  float acc[R][kTile] = {};
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint16_t* d = c.d + (tile * c.blocks + b) * kTile;
    const uint16_t* m = c.m != nullptr ? c.m + (tile * c.blocks + b) * kTile : nullptr;
    for (int r = 0; r < R; ++r) {
      const int64_t t = t0 + r;
      const int8_t* x = c.xq + t * c.K + b * kBlock;
      for (int64_t lane = 0; lane < kTile; ++lane) {
        int32_t s = 0;
        for (int64_t g = 0; g < kGroups; ++g) {
          for (int64_t j = 0; j < 4; ++j) {
            s += code_plain(c, tile, b, g, lane, j) * int32_t{x[4 * g + j]};
          }
        }
        const float scale = half_to_float(d[lane]) * c.dx[t * c.blocks + b];
        acc[r][lane] = std::fma(static_cast<float>(s), scale, acc[r][lane]);
        if (m != nullptr) {
          acc[r][lane] = std::fma(half_to_float(m[lane]), c.sx[t * c.blocks + b], acc[r][lane]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t lane = 0; lane < kTile && tile * kTile + lane < c.N; ++lane) {
      c.out[(t0 + r) * c.ldo + tile * kTile + lane] = acc[r][lane];
    }
  }
}

template <int R>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void rows_avx2(const Call& c, int64_t tile,
                                                                                int64_t t0) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* wb = c.codes + (tile * c.blocks + b) * code_bytes(c);
    prefetch_ahead(c, tile, b);
#pragma GCC unroll 8
    for (int h = 0; h < 2; ++h) {  // outputs 8 h .. 8 h + 7
      __m256i w[kGroups];
#pragma GCC unroll 8
      for (int64_t g = 0; g < (c.eight ? kGroups : kGroups / 2); ++g) {
        const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (g * kTile + 8 * h) * 4));
        if (c.eight) {
          w[g] = _mm256_xor_si256(y, flip);  // the signed code
        } else {
          w[g] = _mm256_and_si256(y, low);
          w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(y, 4), low);
        }
      }
      const __m256 d = load8_half(c.d + (tile * c.blocks + b) * kTile + 8 * h);
      const __m256 m = c.m != nullptr ? load8_half(c.m + (tile * c.blocks + b) * kTile + 8 * h) : d;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t t = t0 + r;
        const int8_t* x = c.xq + t * c.K + b * kBlock;
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int64_t g = 0; g < kGroups; ++g) {
          int32_t four;
          std::memcpy(&four, x + 4 * g, 4);
          __m256i xv = _mm256_set1_epi32(four), wv = w[g];
          if (c.eight) {  // |w| times x with w's sign: u8 x s8 pairs, no saturation (128 * 127 * 2 < 2^15)
            xv = _mm256_sign_epi8(xv, wv);
            wv = _mm256_abs_epi8(wv);
          }
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
        }
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(c.dx[t * c.blocks + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r][h]);
        if (c.m != nullptr) {
          acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(c.sx[t * c.blocks + b]), acc[r][h]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float y[kTile];
    _mm256_storeu_ps(y, acc[r][0]);
    _mm256_storeu_ps(y + 8, acc[r][1]);
    const int64_t n = std::min(kTile, c.N - tile * kTile);
    std::memcpy(c.out + (t0 + r) * c.ldo + tile * kTile, y, sizeof(float) * n);
  }
}

#define CASSPEC_VNNI "avx512f,avx512bw,avx512vl,avx512vnni"
template <int R>
__attribute__((target(CASSPEC_VNNI), always_inline)) inline void rows_vnni(const Call& c, int64_t tile, int64_t t0) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* wb = c.codes + (tile * c.blocks + b) * code_bytes(c);
    prefetch_ahead(c, tile, b);
    __m512i w[kGroups];  // u8: the code + 128 (8-bit), or the code (4-bit)
    if (c.eight) {
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups; ++g) {
        w[g] = _mm512_loadu_si512(wb + g * kTile * 4);
      }
    } else {
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups / 2; ++g) {
        const __m512i y = _mm512_loadu_si512(wb + g * kTile * 4);
        w[g] = _mm512_and_si512(y, low);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(y, 4), low);
      }
    }
    const __m512 d = load16_half(c.d + (tile * c.blocks + b) * kTile);
    const __m512 m = c.m != nullptr ? load16_half(c.m + (tile * c.blocks + b) * kTile) : d;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t t = t0 + r;
      const int8_t* x = c.xq + t * c.K + b * kBlock;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // (two chains: exact either way)
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups; g += 2) {  // (each group's 4 activation bytes broadcast from memory)
        even = _mm512_dpbusd_epi32(even, w[g], _mm512_broadcastd_epi32(_mm_loadu_si32(x + 4 * g)));
        odd = _mm512_dpbusd_epi32(odd, w[g + 1], _mm512_broadcastd_epi32(_mm_loadu_si32(x + 4 * g + 4)));
      }
      __m512i s = _mm512_add_epi32(even, odd);
      if (c.eight) {  // (code + 128) . x - 128 sum(x)
        s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * c.xsum[t * c.blocks + b]));
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(c.dx[t * c.blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
      if (c.m != nullptr) {
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(c.sx[t * c.blocks + b]), acc[r]);
      }
    }
  }
  const int64_t n = std::min(kTile, c.N - tile * kTile);
  const __mmask16 valid = static_cast<__mmask16>(n == kTile ? 0xFFFF : (1u << n) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(c.out + (t0 + r) * c.ldo + tile * kTile, valid, acc[r]);
  }
}

// tiles [tile0, tile1) of every row, up to WIDE rows at a time, then 4, then the last 1-3 (one function per
// instruction set: its loops inline, each row tile's accumulators in registers; a row's arithmetic is the same in
// any row tile)
#define CASSPEC_RANGE(NAME, TARGET, ROWS, WIDE)                     \
  TARGET void NAME(const Call& c, int64_t tile0, int64_t tile1) {   \
    for (int64_t tile = tile0; tile < tile1; ++tile) {              \
      int64_t t0 = 0;                                               \
      for (; t0 + WIDE <= c.T; t0 += WIDE) {                        \
        ROWS<WIDE>(c, tile, t0);                                    \
      }                                                             \
      if (WIDE > 4 && t0 + 4 <= c.T) {                              \
        ROWS<4>(c, tile, t0);                                       \
        t0 += 4;                                                    \
      }                                                             \
      switch (c.T - t0) {                                           \
        case 3:                                                     \
          ROWS<3>(c, tile, t0);                                     \
          break;                                                    \
        case 2:                                                     \
          ROWS<2>(c, tile, t0);                                     \
          break;                                                    \
        case 1:                                                     \
          ROWS<1>(c, tile, t0);                                     \
          break;                                                    \
        default:                                                    \
          break;                                                    \
      }                                                             \
    }                                                               \
  }
CASSPEC_RANGE(range_plain, , rows_plain, 4)
CASSPEC_RANGE(range_avx2, __attribute__((target("avx2,fma,f16c"))), rows_avx2, 4)
CASSPEC_RANGE(range_vnni, __attribute__((target(CASSPEC_VNNI))), rows_vnni, kRowTile)
#undef CASSPEC_RANGE
static_assert(kRowTile == 4 || kRowTile == 8, "CASSPEC_RANGE takes 4 rows, then the last 1-3");

}  // namespace

namespace raw {

// the block product's widest path here (ops.h machine_isa): its AVX-512 path needs VNNI, BW and VL besides (else AVX2)
Isa block_isa() {
  static const Isa isa = [] {
    const Isa cap = machine_isa();
    __builtin_cpu_init();
    if (cap == kAvx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return kAvx512;
    }
    return cap >= kAvx2 && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") ? kAvx2 : kPlain;
  }();
  return isa;
}

}  // namespace raw

namespace {
typedef float f16v __attribute__((vector_size(64), aligned(4)));  // 16 floats (unaligned loads and stores)
typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));

// per block: dx = max |x| / 127, xq = x / dx rounded to nearest (even: adding and subtracting 1.5 * 2^23 rounds a
// float below 2^22 so, as nearbyint does), their sum, sx = dx * that sum. 16 lanes at a time in every path: the
// same operations, each exact or correctly rounded, so the same bits.
[[gnu::always_inline]] inline void quantize_impl(const float* x, const raw::BlockActs& a, int64_t b0, int64_t b1) {
  const f16v big = f16v{} + 12582912.0f;
  const i16v magnitude = i16v{} + 0x7fffffff;
  for (int64_t at = b0; at < b1; ++at) {  // (block `at` of the rows' blocks: its inputs lie at x + at * 32)
    f16v v[2];
    std::memcpy(v, x + at * kBlock, sizeof(v));
    f16v top16 = {};
    for (int h = 0; h < 2; ++h) {
      i16v bits = reinterpret_cast<i16v&>(v[h]) & magnitude;
      const f16v mag = reinterpret_cast<f16v&>(bits);
      top16 = mag > top16 ? mag : top16;  // (a NaN is passed over, as std::max(top, NaN) keeps top)
    }
    float top = 0.f;
    for (int i = 0; i < 16; ++i) {
      top = std::max(top, top16[i]);
    }
    const float scale = top / 127.f;
    const float inv = scale != 0.f ? 1.f / scale : 0.f;
    i16v sum = {};
    int8_t* q = a.xq + at * kBlock;
    for (int h = 0; h < 2; ++h) {
      const i16v r = __builtin_convertvector((v[h] * inv + big) - big, i16v);
      sum += r;
      for (int i = 0; i < 16; ++i) {
        q[16 * h + i] = static_cast<int8_t>(r[i]);
      }
    }
    int32_t total = 0;
    for (int i = 0; i < 16; ++i) {
      total += sum[i];
    }
    a.dx[at] = scale;
    a.xsum[at] = total;
    a.sx[at] = scale * static_cast<float>(total);
  }
}
__attribute__((target("avx512f,avx512bw"))) void quantize_avx512(const float* x, const raw::BlockActs& a, int64_t b0,
                                                                 int64_t b1) {
  quantize_impl(x, a, b0, b1);
}
__attribute__((target("avx2"))) void quantize_avx2(const float* x, const raw::BlockActs& a, int64_t b0, int64_t b1) {
  quantize_impl(x, a, b0, b1);
}
}  // namespace

namespace raw {

void quantize_blocks(const float* x, const BlockActs& a, int64_t b0, int64_t b1) {
  static const Isa isa = machine_isa();
  if (isa == kAvx512) {
    quantize_avx512(x, a, b0, b1);
  } else if (isa == kAvx2) {
    quantize_avx2(x, a, b0, b1);
  } else {
    quantize_impl(x, a, b0, b1);
  }
}

void block_tiles(const Blocks& w, const BlockActs& a, int64_t T, float* out, int64_t ldo, int64_t tile0,
                 int64_t tile1, Isa isa) {
  const Call c{w.codes, w.eight, w.d, w.m, a.xq, a.dx, a.sx, a.xsum, out, w.N, T, w.K, w.K / kBlock, ldo};
  if (isa == kAvx512) {
    range_vnni(c, tile0, tile1);
  } else if (isa == kAvx2) {
    range_avx2(c, tile0, tile1);
  } else {
    range_plain(c, tile0, tile1);
  }
}

}  // namespace raw

// x [T, K] float32; codes [tiles, blocks, 4 or 8, 16, 4] uint8 (dsia/blockq.py); scales [1 or 2, tiles, blocks,
// 16] float16 (d, and m where w = d q + m); n: the outputs (<= 16 tiles); isa: -1 the best this CPU has, else 0
// plain, 1 AVX2, 2 AVX-512 VNNI (tests). -> [T, n]
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                        int64_t isa) {
  check_tensor(x, "block_linear x [T, K]", at::kFloat, 2);
  check_tensor(codes, "block_linear codes [tiles, blocks, 4 or 8, 16, 4]", at::kByte, 5);
  check_tensor(scales, "block_linear scales [1 or 2, tiles, blocks, 16]", at::kHalf, 4);
  const int64_t T = x.size(0), K = x.size(1), tiles = codes.size(0), blocks = codes.size(1);
  TORCH_CHECK(codes.is_contiguous() && (codes.size(2) == kGroups || codes.size(2) == kGroups / 2) &&
                  codes.size(3) == kTile && codes.size(4) == 4,
              "casspec block_linear: codes [tiles, blocks, 4 or 8, 16, 4] contiguous expected, got ", codes.sizes());
  TORCH_CHECK(scales.is_contiguous() && (scales.size(0) == 1 || scales.size(0) == 2) && scales.size(1) == tiles &&
                  scales.size(2) == blocks && scales.size(3) == kTile,
              "casspec block_linear: scales [1 or 2, ", tiles, ", ", blocks, ", 16] contiguous expected, got ",
              scales.sizes());
  TORCH_CHECK(tiles >= 1 && n >= 1 && n <= kTile * tiles && n > kTile * (tiles - 1), "casspec block_linear: ", n,
              " outputs do not fill the last of ", tiles, " tiles of 16");
  TORCH_CHECK(K == kBlock * blocks, "casspec block_linear: x has ", K, " inputs, the codes ", kBlock * blocks);
  TORCH_CHECK(isa >= kAuto && isa <= raw::block_isa(), "casspec block_linear: isa ", isa,
              " is not one this CPU runs (or CASSPEC_ISA allows): -1 the best, 0 plain, 1 AVX2, 2 AVX-512 VNNI");
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = x.new_empty({T, K}, x.options().dtype(at::kChar));
  at::Tensor dx = x.new_empty({T, blocks}), sx = x.new_empty({T, blocks});
  at::Tensor xsum = x.new_empty({T, blocks}, x.options().dtype(at::kInt));
  const raw::BlockActs acts{xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>(),
                            xsum.data_ptr<int32_t>()};
  raw::quantize_blocks(xc.data_ptr<float>(), acts, 0, T * blocks);
  at::Tensor out = x.new_empty({T, n});
  const uint16_t* d = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const raw::Blocks w{codes.data_ptr<uint8_t>(), codes.size(2) == kGroups, d,
                      scales.size(0) == 2 ? d + tiles * blocks * kTile : nullptr, n, K};
  const Isa use = isa == kAuto ? raw::block_isa() : static_cast<Isa>(isa);
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, T * K * kTile));
  at::parallel_for(0, tiles, grain, [&](int64_t tile0, int64_t tile1) {
    raw::block_tiles(w, acts, T, out.data_ptr<float>(), n, tile0, tile1, use);
  });
  return out;
}

}  // namespace casspec
