// (included once per instruction set by dense.cpp, inside its namespace, with `Vec` defined: 16 float lanes, loaded
// from float32 or from bfloat16's bits (Wt: float or uint16_t, the weights', the bias's and the output's type); x is
// float32 (bfloat16 inputs widened exactly by the caller))
// Group g holds outputs [64 g, 64 g + 64) as [K][64] (dense_pack): its 4 vectors of 16 outputs at each input. Output
// n of row t: acc = 0, then for k = 0, 1, ..., K - 1 in order acc = fma(w[n, k], x[t, k], acc), one rounding each;
// the bias added last. A tile of O vectors by R rows loads each of its weights once for its R rows, and the rows'
// next tiles find them in the cache. No sum is ever folded across lanes: lane l of vector v is output 64 g + 16 v +
// l.

// What a tile prefetches: a group swept once (one row tile, one part) its own stream kAheadBytes ahead
// (the groups lie one after the other, so this runs on into the next); a group swept s times, in sweep i lines
// [i, i + 1) * L / s of the next group (L its lines), evenly over the sweep's inputs, so that memory streams the next
// group while the cached one is computed (and no further: prefetching on into the group after cost 1.3x at 16 rows)
struct Ahead {
  const char* from;  // the first line to prefetch
  int64_t lines;  // lines to prefetch, evenly over the tile's inputs (0: its own stream ahead instead)
};

template <int O, int R, class Wt>
[[gnu::always_inline]] inline void tile(const Job<Wt>& j, int64_t g, int64_t v0, int64_t t0, Ahead ahead) {
  const int64_t K = j.K;
  Vec acc[O][R];
#pragma GCC unroll 16
  for (int o = 0; o < O; ++o) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[o][r] = Vec::zero();
    }
  }
  const Wt* w = j.w + g * K * kGroup + v0 * kLanes;
  const float* x = j.x + t0 * K;
  constexpr int64_t kLines = kGroup * sizeof(Wt) / 64;  // cache lines of a group's weights at one input
  const char* next = ahead.from;
  int64_t frac = 0;  // (Bresenham: lines * k / K of them prefetched before input k; front-loading them cost 1.15x)
  for (int64_t k = 0; k < K; ++k) {
    if (ahead.lines == 0) {
#pragma GCC unroll 4
      for (int64_t l = 0; l < kLines; ++l) {
        __builtin_prefetch(reinterpret_cast<const char*>(w - v0 * kLanes + k * kGroup) + l * 64 + kAheadBytes, 0, 3);
      }
    }
    for (frac += ahead.lines; frac >= K; frac -= K, next += 64) {
      __builtin_prefetch(next, 0, 3);
    }
    Vec xv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      xv[r] = Vec::broadcast(x[r * K + k]);
    }
#pragma GCC unroll 16
    for (int o = 0; o < O; ++o) {
      const Vec wv = Vec::load(w + k * kGroup + o * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[o][r] = Vec::fma(wv, xv[r], acc[o][r]);
      }
    }
  }
  for (int o = 0; o < O; ++o) {
    const int64_t n0 = g * kGroup + (v0 + o) * kLanes, count = std::min(kLanes, j.N - n0);
    for (int r = 0; r < R; ++r) {
      if constexpr (std::is_same_v<Wt, float>) {
        if (count == kLanes && j.bias == nullptr) {  // (the common case: 16 float32 sums stored as they are)
          acc[o][r].store(j.y + (t0 + r) * j.ldy + n0);
          continue;
        }
      }
      float sums[kLanes];
      acc[o][r].store(sums);
      if (j.yf != nullptr) {  // (bfloat16 panels, no bias: each sum rounded to bfloat16, as narrow<Wt> rounds it)
        float* yf = j.yf + (t0 + r) * j.ldy + n0;
        for (int64_t l = 0; l < count; ++l) {
          yf[l] = round_bf16(sums[l]);
        }
        continue;
      }
      Wt* y = j.y + (t0 + r) * j.ldy + n0;
      for (int64_t l = 0; l < count; ++l) {
        y[l] = narrow<Wt>(j.bias != nullptr ? sums[l] + widen(j.bias[n0 + l]) : sums[l]);
      }
    }
  }
}

// the last rows from t0 (fewer than a full tile's: exactly R, or fewer)
template <int O, int R, class Wt>
void last_rows(const Job<Wt>& j, int64_t g, int64_t v0, int64_t t0, Ahead ahead) {
  if (j.T - t0 == R) {
    tile<O, R>(j, g, v0, t0, ahead);
  } else if constexpr (R > 1) {
    last_rows<O, R - 1>(j, g, v0, t0, ahead);
  }
}

// vectors [v_lo, v_hi) of group g, every row, in tiles of O vectors by R rows (the last rows, fewer than R, in one
// smaller tile), prefetching the `next` group (nullptr: none) evenly over its sweeps
template <int O, int R, class Wt>
void group(const Job<Wt>& j, int64_t g, int64_t v_lo, int64_t v_hi, const char* next) {
  static_assert(kGroup / kLanes % O == 0, "a tile takes a whole part of a group");
  const int64_t sweeps = (j.T + R - 1) / R * ((v_hi - v_lo) / O);
  const int64_t lines = j.K * kGroup * static_cast<int64_t>(sizeof(Wt)) / 64;  // a group's
  int64_t sweep = 0;
  for (int64_t t = 0; t < j.T; t += R) {
    for (int64_t v0 = v_lo; v0 < v_hi; v0 += O, ++sweep) {
      const int64_t l0 = sweep * lines / sweeps, l1 = (sweep + 1) * lines / sweeps;
      // (swept once, or the range's last group: the own stream, which runs on into the next range's)
      const Ahead ahead{next + l0 * 64, sweeps > 1 && next != nullptr ? l1 - l0 : 0};
      if (t + R <= j.T) {
        tile<O, R>(j, g, v0, t, ahead);
      } else if constexpr (R > 1) {
        last_rows<O, R - 1>(j, g, v0, t, ahead);
      }
    }
  }
}

// halves [a, b) of the groups (32 outputs each: two threads share an odd number of groups evenly), every row: whole
// groups in tiles of O vectors, a half group in tiles of at most 2. The tile shape changes only which sums run side
// by side, never one sum's order: every shape gives the same bits.
template <int O, int R, class Wt>
void tiles(const Job<Wt>& j, int64_t a, int64_t b) {
  constexpr int64_t kHalf = kGroup / kLanes / 2;  // vectors
  constexpr int kHalfO = O < 2 ? O : 2;
  for (int64_t g = a / 2; g < (b + 1) / 2; ++g) {
    const int64_t v_lo = (std::max(a, 2 * g) - 2 * g) * kHalf, v_hi = (std::min(b, 2 * g + 2) - 2 * g) * kHalf;
    const char* next = g + 1 < (b + 1) / 2 ? reinterpret_cast<const char*>(j.w + (g + 1) * j.K * kGroup) : nullptr;
    if (v_hi - v_lo == 2 * kHalf) {
      group<O, R>(j, g, v_lo, v_hi, next);
    } else {
      group<kHalfO, R>(j, g, v_lo, v_hi, next);
    }
  }
}
