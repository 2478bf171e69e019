// A GGUF-style block-quantized product on the CPU (torch.ops.casspec.block_linear): weights as the file stores them
// (every GGUF block type from Q2_K to Q8_0, ops.h BlockFormat: per block of 32 inputs and output, unsigned codes u
// and w = D a (u + offset) + Dm b, a and b integers per sub-block, D and Dm float16 per super-block), times the
// activations quantized per row and block of 32 to 8 bits (dx per block, as llama.cpp's q8_0). Per row, output and
// block, in integers (exact): lo, hi = each half block's u . xq (+ offset times the half's sum of xq); S = a0 lo +
// a1 hi (a0 (lo + hi), one sum, where a block is one sub-block); then in float32, two fused multiply-adds into one
// accumulator in block order:
//   acc = fma(float(S), D dx, acc);  then one sub-block:  acc = fma(Dm b0, dxsum, acc),  dxsum = dx (xsum0 + xsum1)
//                                         two:            acc = fma(B, Dm dx, acc),  B = b0 xsum0 + b1 xsum1
// (Dm b0 (b0 = 1 without sub-block mins) and B are exact in float32; dxsum is rounded once, where the activations are
// quantized, so that most formats' minimum term is one multiply-add a row and block.)
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
#include <vector>

#include "ops.h"
#include "vec16.h"

namespace casspec {
namespace {

constexpr int64_t kBlock = raw::kBlockInputs;  // weights per block (32)
constexpr int64_t kTile = 16;  // outputs per tile, one per float lane
constexpr int64_t kGroups = kBlock / 4;  // groups of 4 inputs per block (a 32-bit lane's 4 bytes)
constexpr int64_t kAheadBytes = 8192;  // how far ahead in the codes (and as many blocks ahead in the scales) a tile's
// loop prefetches: the native SmolLM2 step's 121 products took 3.3-3.4 ms with it against 3.5-4.0 without (AMD EPYC)
typedef int32_t alias_i32 __attribute__((may_alias, aligned(1)));  // 4 activation bytes read as one lane
constexpr int kRowTile = 8;  // rows that share each unpacked block on AVX-512 (AVX2's 16 registers: 4)

// A call's operands. Activations: xq [T, K] int8, dx [T, blocks], xsum [T, 2 blocks] (each half block's sum of xq).
struct Call {
  const uint8_t* codes;  // [tiles, blocks, f.record()]
  raw::BlockFormat f;
  const uint16_t* d;  // [tiles, blocks / f.super, 16] float16 bits (as GGUF stores a block's scales; widened exactly)
  const uint16_t* m;  // the same, Dm, or nullptr (f.mins 0)
  const int8_t* xq;
  const float* dx;
  const int32_t* xsum;
  const float* dxsum;  // [T, blocks]: each block's dx (xsum0 + xsum1)
  float* out;  // [T, N], rows ldo apart
  int64_t N, T, K, blocks, ldo;
  // the full tiles of kRowTile rows' activations side by side (AVX-512: raw::tile_acts), per row tile and block: the
  // rows' 32 bytes [kRowTile, 32], xsum pairs [kRowTile, 2], dx and dxsum [kRowTile]; so that a row tile reads its
  // rows at constant offsets from one pointer (8 rows' own pointers did not fit the registers beside the block's)
  raw::TiledActs tiled;

  const uint8_t* at(int64_t tile, int64_t b, const raw::BlockFormat& g) const {
    return codes + (tile * blocks + b) * g.record();
  }
  // (tile, b)'s scales: super-blocks lie one after another across tiles (blocks is a multiple of super)
  int64_t scale_at(int64_t tile, int64_t b, const raw::BlockFormat& g) const {
    return (tile * blocks + b) / g.super * kTile;
  }
  const uint8_t* planes(int64_t tile, int64_t b, const raw::BlockFormat& g) const {
    return at(tile, b, g) + g.base_bytes();
  }
  const int8_t* mult(int64_t tile, int64_t b, const raw::BlockFormat& g) const {  // a [sub-blocks, 16]
    return reinterpret_cast<const int8_t*>(planes(tile, b, g) + g.planes * 64);
  }
  const int8_t* mins(int64_t tile, int64_t b, const raw::BlockFormat& g) const {  // b [sub-blocks, 16]
    return mult(tile, b, g) + (g.scaled ? 16 * g.subblocks() : 0);
  }
};

// The format a kernel is compiled for: Dynamic reads it from the call; Fixed<...> is one known when compiling (the
// GGUF types), so that its loops test nothing and divide by constants (the same operations, so the same bits)
struct Dynamic {
  static raw::BlockFormat of(const raw::BlockFormat& f) { return f; }
};
template <int Base, int Planes, bool Scaled, bool Halves, int Mins, int Super, int Offset>
struct Fixed {
  static raw::BlockFormat of(const raw::BlockFormat&) {
    return raw::BlockFormat{Base, Planes, Scaled, Halves, Mins, Super, Offset};
  }
  static bool is(const raw::BlockFormat& f) {
    return f.base == Base && f.planes == Planes && f.scaled == Scaled && f.halves == Halves && f.mins == Mins &&
           f.super == Super && f.offset == Offset;
  }
};
// dsia/blockq.py FORMATS
using Q4_0 = Fixed<4, 0, false, false, 0, 1, -8>;
using Q4_1 = Fixed<4, 0, false, false, 1, 1, 0>;
using Q5_0 = Fixed<4, 1, false, false, 0, 1, -16>;
using Q5_1 = Fixed<4, 1, false, false, 1, 1, 0>;
using Q8_0 = Fixed<8, 0, false, false, 0, 1, -128>;
using Q2_K = Fixed<0, 2, true, true, 2, 8, 0>;
using Q3_K = Fixed<0, 3, true, true, 0, 8, -4>;
using Q4_K = Fixed<4, 0, true, false, 2, 8, 0>;
using Q5_K = Fixed<4, 1, true, false, 2, 8, 0>;
using Q6_K = Fixed<4, 2, true, true, 0, 8, -32>;

// prefetch the codes and scales kAheadBytes of codes past block b of `tile` (tiles lie one after another, so past a
// tile's last block come the next tile's first), where that lies within the weight
template <class F>
[[gnu::always_inline]] inline void prefetch_ahead(const Call& c, int64_t tile, int64_t b) {
  const raw::BlockFormat f = F::of(c.f);
  const int64_t record = f.record();
  const int64_t at = tile * c.blocks + b + std::max<int64_t>(1, kAheadBytes / record);
  if (at >= (c.N + kTile - 1) / kTile * c.blocks) {
    return;
  }
  for (int64_t line = 0; line < record; line += 64) {
    __builtin_prefetch(c.codes + at * record + line, 0, 3);
  }
  const int64_t s = at / f.super * kTile;
  __builtin_prefetch(c.d + s, 0, 3);
  if (c.m != nullptr) {
    __builtin_prefetch(c.m + s, 0, 3);
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

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// the code u of output lane `lane`, input 4 g + j of block b of tile `tile`, plain
inline int32_t code_plain(const Call& c, int64_t tile, int64_t b, int64_t g, int64_t lane, int64_t j) {
  const uint8_t* w = c.at(tile, b, c.f);
  const int64_t byte = lane * 4 + j;
  int32_t u = 0;
  if (c.f.base == 8) {
    u = w[g * 64 + byte];
  } else if (c.f.base == 4) {
    const uint8_t two = w[(g % 4) * 64 + byte];
    u = g < 4 ? two & 15 : two >> 4;
  }
  for (int p = 0; p < c.f.planes; ++p) {
    u += static_cast<int32_t>((load_u64(c.planes(tile, b, c.f) + p * 64 + g * 8) >> byte) & 1) << (c.f.base + p);
  }
  return u;
}

template <int R>
[[gnu::always_inline]] inline void rows_plain(const Call& c, int64_t tile, int64_t t0) {
  float acc[R][kTile] = {};
  const int64_t H = c.f.subblocks();
  for (int64_t b = 0; b < c.blocks; ++b) {
    const int64_t s = c.scale_at(tile, b, c.f);
    const int8_t* a = c.mult(tile, b, c.f);
    const int8_t* bm = c.mins(tile, b, c.f);
    for (int r = 0; r < R; ++r) {
      const int64_t t = t0 + r;
      const int8_t* x = c.xq + t * c.K + b * kBlock;
      const int32_t xs0 = c.xsum[t * 2 * c.blocks + 2 * b], xs1 = c.xsum[t * 2 * c.blocks + 2 * b + 1];
      const float dx = c.dx[t * c.blocks + b];
      for (int64_t lane = 0; lane < kTile; ++lane) {
        int32_t half[2] = {0, 0};
        for (int64_t g = 0; g < kGroups; ++g) {
          for (int64_t j = 0; j < 4; ++j) {
            half[g / 4] += code_plain(c, tile, b, g, lane, j) * int32_t{x[4 * g + j]};
          }
        }
        half[0] += c.f.offset * xs0;
        half[1] += c.f.offset * xs1;
        int32_t S = half[0] + half[1];
        if (c.f.scaled) {
          S = H == 2 ? a[lane] * half[0] + a[16 + lane] * half[1] : a[lane] * S;
        }
        acc[r][lane] = std::fma(static_cast<float>(S), half_to_float(c.d[s + lane]) * dx, acc[r][lane]);
        const float m = c.f.mins != 0 ? half_to_float(c.m[s + lane]) : 0.f;
        if (c.f.mins == 2 && H == 2) {
          const float B = static_cast<float>(bm[lane]) * static_cast<float>(xs0) +
                          static_cast<float>(bm[16 + lane]) * static_cast<float>(xs1);
          acc[r][lane] = std::fma(B, m * dx, acc[r][lane]);
        } else if (c.f.mins != 0) {
          const float mb = c.f.mins == 1 ? m : m * static_cast<float>(bm[lane]);
          acc[r][lane] = std::fma(mb, c.dxsum[t * c.blocks + b], acc[r][lane]);
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

// 32 bits -> 32 bytes, 0xFF where the bit is set (byte k: bit k)
__attribute__((target("avx2"), always_inline)) inline __m256i expand_bits(uint32_t bits) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                        3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), pick), bit);
  return _mm256_cmpeq_epi8(v, bit);
}

template <int R, class F>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void rows_avx2(const Call& c, int64_t tile,
                                                                                int64_t t0) {
  const raw::BlockFormat f = F::of(c.f);
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8(-128);
  const bool eight = f.base == 8, two = f.halves;
  // (8-bit codes are multiplied as u - 128 with x's sign trick: maddubs would saturate u8 x s8 pairs over 127)
  const int32_t offset = eight ? f.offset + 128 : f.offset;
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* wb = c.at(tile, b, f);
    const uint8_t* pl = c.planes(tile, b, f);
    prefetch_ahead<F>(c, tile, b);
    const int64_t s = c.scale_at(tile, b, f);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // outputs 8 h .. 8 h + 7
      __m256i w[kGroups];
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups; ++g) {
        w[g] = _mm256_setzero_si256();
      }
      if (eight) {
#pragma GCC unroll 8
        for (int64_t g = 0; g < kGroups; ++g) {
          w[g] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + 32 * h)), flip);
        }
      } else if (f.base == 4) {
#pragma GCC unroll 4
        for (int64_t g = 0; g < kGroups / 2; ++g) {
          const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + 32 * h));
          w[g] = _mm256_and_si256(y, low);
          w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(y, 4), low);
        }
      }
      for (int p = 0; p < f.planes; ++p) {
        const __m256i add = _mm256_set1_epi8(static_cast<char>(1 << (f.base + p)));
#pragma GCC unroll 8
        for (int64_t g = 0; g < kGroups; ++g) {
          const uint32_t bits = static_cast<uint32_t>(load_u64(pl + p * 64 + g * 8) >> (32 * h));
          w[g] = _mm256_add_epi8(w[g], _mm256_and_si256(expand_bits(bits), add));
        }
      }
      const __m256 d = load8_half(c.d + s + 8 * h);
      const __m256 m = c.m != nullptr ? load8_half(c.m + s + 8 * h) : d;
      const int8_t* ap = c.mult(tile, b, f) + 8 * h;
      const int8_t* bp = c.mins(tile, b, f) + 8 * h;
      const __m256i a0 = f.scaled ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ap)))
                                    : _mm256_set1_epi32(1);
      const __m256i a1 = f.scaled && two
                             ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ap + 16)))
                             : a0;
      __m256 b0 = _mm256_setzero_ps(), b1 = b0;
      if (f.mins == 2) {
        b0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bp))));
        b1 = two ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bp + 16))))
                 : b0;
      }
      const __m256 mb = f.mins == 2 && !two ? _mm256_mul_ps(m, b0) : m;  // Dm b0 (exact)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t t = t0 + r;
        const int8_t* x = c.xq + t * c.K + b * kBlock;
        const int32_t xs0 = c.xsum[t * 2 * c.blocks + 2 * b], xs1 = c.xsum[t * 2 * c.blocks + 2 * b + 1];
        // (one sum over the block where it has one sub-block, the offset's term in it from the start)
        __m256i half[2] = {two ? _mm256_set1_epi32(offset * xs0) : _mm256_set1_epi32(offset * (xs0 + xs1)),
                           _mm256_set1_epi32(offset * xs1)};
#pragma GCC unroll 8
        for (int64_t g = 0; g < kGroups; ++g) {
          int32_t four;
          std::memcpy(&four, x + 4 * g, 4);
          __m256i xv = _mm256_set1_epi32(four), wv = w[g];
          if (eight) {  // |w| times x with w's sign: u8 x s8 pairs, no saturation (128 * 127 * 2 < 2^15)
            xv = _mm256_sign_epi8(xv, wv);
            wv = _mm256_abs_epi8(wv);
          }
          const int64_t into = two ? g / 4 : 0;
          half[into] = _mm256_add_epi32(half[into], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
        }
        const __m256i S =
            !two       ? (f.scaled ? _mm256_mullo_epi32(a0, half[0]) : half[0])
            : f.scaled ? _mm256_add_epi32(_mm256_mullo_epi32(a0, half[0]), _mm256_mullo_epi32(a1, half[1]))
                       : _mm256_add_epi32(half[0], half[1]);
        const __m256 dx = _mm256_set1_ps(c.dx[t * c.blocks + b]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, dx), acc[r][h]);
        if (f.mins == 2 && two) {
          const __m256 B = _mm256_add_ps(_mm256_mul_ps(b0, _mm256_set1_ps(static_cast<float>(xs0))),
                                         _mm256_mul_ps(b1, _mm256_set1_ps(static_cast<float>(xs1))));
          acc[r][h] = _mm256_fmadd_ps(B, _mm256_mul_ps(m, dx), acc[r][h]);
        } else if (f.mins != 0) {
          acc[r][h] = _mm256_fmadd_ps(mb, _mm256_set1_ps(c.dxsum[t * c.blocks + b]), acc[r][h]);
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
template <int R, class F>
__attribute__((target(CASSPEC_VNNI), always_inline)) inline void rows_vnni(const Call& c, int64_t tile, int64_t t0) {
  const raw::BlockFormat f = F::of(c.f);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(15);
  const bool two = f.halves;
  // row t0 + r's block b: its 32 bytes, its halves' sums of them, dx, dxsum (a full row tile's from c's tiled copy)
  constexpr bool tiled = R == kRowTile;
  const int64_t first = t0 / kRowTile * c.blocks;  // (tiled) the row tile's first record
  auto xb = [&](int r, int64_t b) {
    return tiled ? c.tiled.xq + ((first + b) * kRowTile + r) * kBlock : c.xq + (t0 + r) * c.K + b * kBlock;
  };
  auto xs = [&](int r, int64_t b) {
    return tiled ? c.tiled.xsum + ((first + b) * kRowTile + r) * 2 : c.xsum + (t0 + r) * 2 * c.blocks + 2 * b;
  };
  auto dx_of = [&](int r, int64_t b) {
    return tiled ? c.tiled.dx[(first + b) * kRowTile + r] : c.dx[(t0 + r) * c.blocks + b];
  };
  auto dxsum_of = [&](int r, int64_t b) {
    return tiled ? c.tiled.dxsum[(first + b) * kRowTile + r] : c.dxsum[(t0 + r) * c.blocks + b];
  };
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* wb = c.at(tile, b, f);
    const uint8_t* pl = c.planes(tile, b, f);
    prefetch_ahead<F>(c, tile, b);
    __m512i w[kGroups];  // u8: the codes
    if (f.base == 8) {
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups; ++g) {
        w[g] = _mm512_loadu_si512(wb + g * 64);
      }
    } else if (f.base == 4) {
#pragma GCC unroll 4
      for (int64_t g = 0; g < kGroups / 2; ++g) {
        const __m512i y = _mm512_loadu_si512(wb + g * 64);
        w[g] = _mm512_and_si512(y, low);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(y, 4), low);
      }
    } else {
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups; ++g) {
        w[g] = _mm512_setzero_si512();
      }
    }
    for (int p = 0; p < f.planes; ++p) {
      const __m512i add = _mm512_set1_epi8(static_cast<char>(1 << (f.base + p)));
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups; ++g) {
        w[g] = _mm512_mask_add_epi8(w[g], _cvtu64_mask64(load_u64(pl + p * 64 + g * 8)), w[g], add);
      }
    }
    const int64_t s = c.scale_at(tile, b, f);
    const __m512 d = load16_half(c.d + s);
    const __m512 m = c.m != nullptr ? load16_half(c.m + s) : d;
    const int8_t* ap = c.mult(tile, b, f);
    const int8_t* bp = c.mins(tile, b, f);
    const __m512i a0 = f.scaled ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ap)))
                                  : _mm512_set1_epi32(1);
    const __m512i a1 = f.scaled && two
                           ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ap + 16)))
                           : a0;
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (f.mins == 2) {
      b0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp))));
      b1 = two ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 16))))
               : b0;
    }
    const __m512 mb = f.mins == 2 && !two ? _mm512_mul_ps(m, b0) : m;  // Dm b0 (exact)
    // S per row: one sum over the block where it has one sub-block (the offset's term in it from the start), the
    // rows' chains of 8 products side by side; lo and hi per row where it has two
    __m512i S[R];
    // row r's 32 bytes of block b: a full row tile's kBlock apart from one base, made opaque to GCC so that it
    // addresses them as constant offsets from it (from xb(r, b) it kept 64 induction variables on the stack: the
    // Q8_0 product over 64 rows ran at 90 GMAC/s a thread against Q4_1's 151, AMD EPYC; 152 with it)
    const int8_t* x0 = xb(0, b);
    asm("" : "+r"(x0));
    auto x_row = [&](int r) { return tiled ? x0 + r * kBlock : xb(r, b); };
    if (!two) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        S[r] = _mm512_set1_epi32(f.offset * (xs(r, b)[0] + xs(r, b)[1]));
      }
#pragma GCC unroll 8
      for (int64_t g = 0; g < kGroups; ++g) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {  // (each group's 4 activation bytes broadcast from memory)
          const alias_i32* x4 = reinterpret_cast<const alias_i32*>(x_row(r));
          S[r] = _mm512_dpbusd_epi32(S[r], w[g], _mm512_set1_epi32(x4[g]));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        S[r] = f.scaled ? _mm512_mullo_epi32(a0, S[r]) : S[r];
      }
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const alias_i32* x4 = reinterpret_cast<const alias_i32*>(x_row(r));  // [8] groups of 4
        const int32_t xs0 = xs(r, b)[0], xs1 = xs(r, b)[1];
        __m512i lo = _mm512_set1_epi32(f.offset * xs0), hi = _mm512_set1_epi32(f.offset * xs1);
#pragma GCC unroll 4
        for (int64_t g = 0; g < kGroups / 2; ++g) {
          lo = _mm512_dpbusd_epi32(lo, w[g], _mm512_set1_epi32(x4[g]));
          hi = _mm512_dpbusd_epi32(hi, w[g + 4], _mm512_set1_epi32(x4[g + 4]));
        }
        S[r] = f.scaled ? _mm512_add_epi32(_mm512_mullo_epi32(a0, lo), _mm512_mullo_epi32(a1, hi))
                        : _mm512_add_epi32(lo, hi);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(dx_of(r, b));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r]), _mm512_mul_ps(d, dx), acc[r]);
      if (f.mins == 2 && two) {
        const int32_t xs0 = xs(r, b)[0], xs1 = xs(r, b)[1];
        const __m512 B = _mm512_add_ps(_mm512_mul_ps(b0, _mm512_set1_ps(static_cast<float>(xs0))),
                                       _mm512_mul_ps(b1, _mm512_set1_ps(static_cast<float>(xs1))));
        acc[r] = _mm512_fmadd_ps(B, _mm512_mul_ps(m, dx), acc[r]);
      } else if (f.mins != 0) {
        acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(dxsum_of(r, b)), acc[r]);
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
  template <class F>                                                \
  TARGET void NAME(const Call& c, int64_t tile0, int64_t tile1) {   \
    for (int64_t tile = tile0; tile < tile1; ++tile) {              \
      int64_t t0 = 0;                                               \
      for (; t0 + WIDE <= c.T; t0 += WIDE) {                        \
        ROWS<WIDE, F>(c, tile, t0);                                 \
      }                                                             \
      if (WIDE > 4 && t0 + 4 <= c.T) {                              \
        ROWS<4, F>(c, tile, t0);                                    \
        t0 += 4;                                                    \
      }                                                             \
      switch (c.T - t0) {                                           \
        case 3:                                                     \
          ROWS<3, F>(c, tile, t0);                                  \
          break;                                                    \
        case 2:                                                     \
          ROWS<2, F>(c, tile, t0);                                  \
          break;                                                    \
        case 1:                                                     \
          ROWS<1, F>(c, tile, t0);                                  \
          break;                                                    \
        default:                                                    \
          break;                                                    \
      }                                                             \
    }                                                               \
  }
CASSPEC_RANGE(range_avx2, __attribute__((target("avx2,fma,f16c"))), rows_avx2, 4)
CASSPEC_RANGE(range_vnni, __attribute__((target(CASSPEC_VNNI))), rows_vnni, kRowTile)
#undef CASSPEC_RANGE
static_assert(kRowTile == 4 || kRowTile == 8, "CASSPEC_RANGE takes 4 rows, then the last 1-3");

// the plain path, its format read at run time
void range_plain(const Call& c, int64_t tile0, int64_t tile1) {
  for (int64_t tile = tile0; tile < tile1; ++tile) {
    int64_t t0 = 0;
    for (; t0 + 4 <= c.T; t0 += 4) {
      rows_plain<4>(c, tile, t0);
    }
    for (; t0 < c.T; ++t0) {
      rows_plain<1>(c, tile, t0);
    }
  }
}

// tiles [tile0, tile1) by the path `isa` names, compiled for format F
template <class F>
void range_of(const Call& c, int64_t tile0, int64_t tile1, Isa isa) {
  if (isa == kAvx512) {
    range_vnni<F>(c, tile0, tile1);
  } else if (isa == kAvx2) {
    range_avx2<F>(c, tile0, tile1);
  } else {
    range_plain(c, tile0, tile1);
  }
}

// the kernel compiled for the call's format where it is a GGUF type (else the one that reads it at run time)
template <class F, class... Rest>
void range_for(const Call& c, int64_t tile0, int64_t tile1, Isa isa) {
  if (F::is(c.f)) {
    range_of<F>(c, tile0, tile1, isa);
  } else if constexpr (sizeof...(Rest) > 0) {
    range_for<Rest...>(c, tile0, tile1, isa);
  } else {
    range_of<Dynamic>(c, tile0, tile1, isa);
  }
}


typedef int8_t i8x16v __attribute__((vector_size(16), aligned(1)));  // 16 bytes

// per block: dx = max |x| / 127, xq = x / dx rounded to nearest (even: adding and subtracting 1.5 * 2^23 rounds a
// float below 2^22 so, as nearbyint does), each half block's sum of xq. 16 lanes at a time in every path: the
// same operations, each exact or correctly rounded, so the same bits (the lanes' largest and sum taken in halves,
// not lane by lane, which took a nanosecond a value on an AMD EPYC: 1.05 -> 1.5 G values/s).
[[gnu::always_inline]] inline void quantize_impl(const float* x, const raw::BlockActs& a, int64_t b0, int64_t b1) {
  const v16 big = v16{} + 12582912.0f;
  const i16 magnitude = i16{} + 0x7fffffff;
  for (int64_t at = b0; at < b1; ++at) {  // (block `at` of the rows' blocks: its inputs lie at x + at * 32)
    v16 v[2];
    std::memcpy(v, x + at * kBlock, sizeof(v));
    v16 top16 = {};
    for (int h = 0; h < 2; ++h) {
      i16 bits = reinterpret_cast<i16&>(v[h]) & magnitude;
      const v16 mag = reinterpret_cast<v16&>(bits);
      top16 = mag > top16 ? mag : top16;  // (a NaN is passed over, as std::max(top, NaN) keeps top)
    }
    const float top = fold_max(top16);
    const float scale = top / 127.f;
    const float inv = scale != 0.f ? 1.f / scale : 0.f;
    int8_t* q = a.xq + at * kBlock;
    for (int h = 0; h < 2; ++h) {
      const i16 r = __builtin_convertvector((v[h] * inv + big) - big, i16);
      const i8x16v bytes = __builtin_convertvector(r, i8x16v);  // (each r's low byte: |r| <= 127)
      std::memcpy(q + 16 * h, &bytes, sizeof(bytes));
      a.xsum[2 * at + h] = fold(r);
    }
    a.dxsum[at] = scale * static_cast<float>(a.xsum[2 * at] + a.xsum[2 * at + 1]);
    a.dx[at] = scale;
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

BlockFormat block_format(int64_t code) {
  BlockFormat f{};
  f.base = static_cast<int>(code & 15);
  f.planes = static_cast<int>((code >> 4) & 3);
  f.scaled = ((code >> 6) & 1) != 0;
  f.halves = ((code >> 7) & 1) != 0;
  f.mins = static_cast<int>((code >> 8) & 3);
  f.super = 1 << ((code >> 10) & 7);
  f.offset = -static_cast<int>((code >> 16) & 0xFFFF);
  TORCH_CHECK(code >= 0 && code < (int64_t{129} << 16) && (code & 0xE000) == 0 &&
                  (f.base == 0 || f.base == 4 || f.base == 8) && f.base + f.planes >= 2 && f.base + f.planes <= 8 &&
                  f.mins <= 2 && (f.super == 1 || f.super == 8) && f.offset >= -128,
              "casspec block_linear: ", code, " is no block format (dsia/blockq.py BlockFormat.code)");
  return f;
}

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

TiledActs tile_acts(const BlockActs& a, int64_t T, int64_t K, Isa isa) {
  if (isa != kAvx512 || T < kRowTile) {
    return {};
  }
  thread_local std::vector<int8_t> xq;  // (this thread's copy: the threads share nothing they write)
  thread_local std::vector<int32_t> xsum;
  thread_local std::vector<float> dx, dxsum;
  const int64_t blocks = K / kBlock, rows = T / kRowTile * kRowTile;
  const int64_t records = rows * blocks;  // (row, block) of the full row tiles
  xq.resize(records * kBlock);
  xsum.resize(records * 2);
  dx.resize(records);
  dxsum.resize(records);
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t at = t / kRowTile * blocks * kRowTile + t % kRowTile;  // (t, block 0)'s record
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t to = at + b * kRowTile, from = t * blocks + b;
      std::memcpy(xq.data() + to * kBlock, a.xq + from * kBlock, kBlock);
      xsum[2 * to] = a.xsum[2 * from];
      xsum[2 * to + 1] = a.xsum[2 * from + 1];
      dx[to] = a.dx[from];
      dxsum[to] = a.dxsum[from];
    }
  }
  return {xq.data(), xsum.data(), dx.data(), dxsum.data()};
}

void block_tiles(const Blocks& w, const BlockActs& a, const TiledActs& tiled, int64_t T, float* out, int64_t ldo,
                 int64_t tile0, int64_t tile1, Isa isa) {
  const bool made = tiled.xq != nullptr || isa != kAvx512 || T < kRowTile;  // (else this call makes its own)
  const Call c{w.codes, w.f, w.d, w.m, a.xq, a.dx, a.xsum, a.dxsum, out, w.N, T, w.K, w.K / kBlock, ldo,
               made ? tiled : tile_acts(a, T, w.K, isa)};
  range_for<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(c, tile0, tile1, isa);
}

}  // namespace raw

// x [T, K] float32; codes [tiles, blocks, record] uint8 (dsia/blockq.py); scales [1 or 2, tiles, blocks / super, 16]
// float16 (D, and Dm where the format has mins); n: the outputs (<= 16 tiles); format: its code; isa: -1 the best
// this CPU has, else 0 plain, 1 AVX2, 2 AVX-512 VNNI (tests). -> [T, n]
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                        int64_t format, int64_t isa) {
  check_tensor(x, "block_linear x [T, K]", at::kFloat, 2);
  check_tensor(codes, "block_linear codes [tiles, blocks, record]", at::kByte, 3);
  check_tensor(scales, "block_linear scales [1 or 2, tiles, super-blocks, 16]", at::kHalf, 4);
  const raw::BlockFormat f = raw::block_format(format);
  const int64_t T = x.size(0), K = x.size(1), tiles = codes.size(0), blocks = codes.size(1);
  TORCH_CHECK(codes.is_contiguous() && codes.size(2) == f.record(), "casspec block_linear: codes [tiles, blocks, ",
              f.record(), "] contiguous expected for format ", format, ", got ", codes.sizes());
  TORCH_CHECK(blocks % f.super == 0, "casspec block_linear: ", blocks, " blocks are no whole super-blocks of ",
              f.super);
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == (f.mins != 0 ? 2 : 1) && scales.size(1) == tiles &&
                  scales.size(2) == blocks / f.super && scales.size(3) == kTile,
              "casspec block_linear: scales [", f.mins != 0 ? 2 : 1, ", ", tiles, ", ", blocks / f.super,
              ", 16] contiguous expected, got ", scales.sizes());
  TORCH_CHECK(tiles >= 1 && n >= 1 && n <= kTile * tiles && n > kTile * (tiles - 1), "casspec block_linear: ", n,
              " outputs do not fill the last of ", tiles, " tiles of 16");
  TORCH_CHECK(K == kBlock * blocks, "casspec block_linear: x has ", K, " inputs, the codes ", kBlock * blocks);
  TORCH_CHECK(isa >= kAuto && isa <= raw::block_isa(), "casspec block_linear: isa ", isa,
              " is not one this CPU runs (or CASSPEC_ISA allows): -1 the best, 0 plain, 1 AVX2, 2 AVX-512 VNNI");
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = x.new_empty({T, K}, x.options().dtype(at::kChar));
  at::Tensor dx = x.new_empty({T, blocks});
  at::Tensor xsum = x.new_empty({T, 2 * blocks}, x.options().dtype(at::kInt));
  at::Tensor dxsum = x.new_empty({T, blocks});
  const raw::BlockActs acts{xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xsum.data_ptr<int32_t>(),
                            dxsum.data_ptr<float>()};
  raw::quantize_blocks(xc.data_ptr<float>(), acts, 0, T * blocks);
  at::Tensor out = x.new_empty({T, n});
  const uint16_t* d = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const raw::Blocks w{codes.data_ptr<uint8_t>(), f, d, f.mins != 0 ? d + tiles * (blocks / f.super) * kTile : nullptr,
                      n, K};
  const Isa use = isa == kAuto ? raw::block_isa() : static_cast<Isa>(isa);
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, T * K * kTile));
  at::parallel_for(0, tiles, grain, [&](int64_t tile0, int64_t tile1) {
    raw::block_tiles(w, acts, raw::tile_acts(acts, T, K, use), T, out.data_ptr<float>(), n, tile0, tile1, use);
  });
  return out;
}

}  // namespace casspec
