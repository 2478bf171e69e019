// (included once per instruction set by dense.cpp, inside its namespace, with `Vec` defined: 16 float lanes, loaded
// from float32 or from bfloat16's bits (Wt: float or uint16_t, the inputs' and the output's type))
// Outputs [o0, o0 + O) of rows [t0, t0 + R): lane l of output o's sum takes inputs k = 16 c + l, c = 0, 1, ... in
// order, one fused multiply-add each (inputs past K are zeros); the lanes folded in halves; the bias added last.

// 16 vectors' fold16, one at a time (a path with a faster way to the same additions defines its own
// fold_many(const Vec*, float*) before including this, which overload resolution prefers)
template <class V>
void fold_many(const V* v, float* out) {
  for (int s = 0; s < 16; ++s) {
    float lanes[kLanes];
    v[s].store(lanes);
    out[s] = fold16(lanes);
  }
}

// one 16-input chunk (n <= 16 inputs, zeros after them) of O weight rows (stride K) into the O x R accumulators
template <int O, int R, class Wt>
[[gnu::always_inline]] inline void step(Vec (&acc)[O][R], const Wt* w, const Wt* x, int64_t K, int64_t n,
                                        const Wt* ahead) {
  Vec wv[O];
#pragma GCC unroll 16
  for (int o = 0; o < O; ++o) {
    wv[o] = Vec::load(w + o * K, n);
  }
  if (ahead != nullptr) {
#pragma GCC unroll 16
    for (int o = 0; o < O; ++o) {
      __builtin_prefetch(ahead + o * K, 0, 3);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const Vec xv = Vec::load(x + r * K, n);
#pragma GCC unroll 16
    for (int o = 0; o < O; ++o) {
      acc[o][r] = Vec::fma(wv[o], xv, acc[o][r]);
    }
  }
}

template <int O, int R, class Wt>
[[gnu::always_inline]] inline void tile(const Job<Wt>& j, int64_t o0, int64_t t0, const Wt* ahead) {
  Vec acc[O][R];
#pragma GCC unroll 16
  for (int o = 0; o < O; ++o) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[o][r] = Vec::zero();
    }
  }
  const int64_t K = j.K, full = K / kLanes * kLanes;
  const Wt* w = j.w + o0 * K;
  const Wt* x = j.x + t0 * K;
  for (int64_t k = 0; k < full; k += kLanes) {
    step<O, R>(acc, w + k, x + k, K, kLanes, ahead != nullptr ? ahead + k : nullptr);
  }
  if (full < K) {  // the last inputs, zeros after them
    step<O, R>(acc, w + full, x + full, K, K - full, static_cast<const Wt*>(nullptr));
  }
  Vec flat[O * R];  // (a copy: the accumulators' own address never escapes the loop, so they stay in registers)
#pragma GCC unroll 16
  for (int o = 0; o < O; ++o) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      flat[o * R + r] = acc[o][r];
    }
  }
  float sums[O * R];  // [o * R + r]
  int i = 0;
  for (; i + 16 <= O * R; i += 16) {
    fold_many(flat + i, sums + i);
  }
  for (; i < O * R; ++i) {
    sums[i] = flat[i].fold();  // (each path's Vec folds with fold16's additions)
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < O; ++o) {
      const float sum = sums[o * R + r];
      j.y[(t0 + r) * j.ldy + o0 + o] = narrow<Wt>(j.bias != nullptr ? sum + widen(j.bias[o0 + o]) : sum);
    }
  }
}

// outputs [o0, o0 + O) of the last `left` rows (fewer than a tile's), from t
template <int O, int R, class Wt>
[[gnu::always_inline]] inline void last_rows(const Job<Wt>& j, int64_t o0, int64_t t, int64_t left,
                                             const Wt* ahead) {
  if constexpr (R > 0) {
    if (left == R) {
      tile<O, R>(j, o0, t, ahead);
    } else {
      last_rows<O, R - 1>(j, o0, t, left, ahead);
    }
  }
}

// outputs [o0, o0 + O) of every row: R rows a tile (the outputs' weights then come from L1 for the next rows)
template <int O, int R, class Wt>
void outputs(const Job<Wt>& j, int64_t o0, const Wt* ahead) {
  int64_t t = 0;
  for (; t + R <= j.T; t += R) {
    tile<O, R>(j, o0, t, t == 0 ? ahead : nullptr);  // (the first rows' pass prefetches weights ahead)
  }
  last_rows<O, R - 1>(j, o0, t, j.T - t, t == 0 ? ahead : nullptr);
}

// outputs [a, b) of every row in tiles of O outputs by R rows. The tile shape changes only which sums run side by
// side, never one sum's order: every shape gives the same bits.
template <int O, int R, class Wt>
void tiles(const Job<Wt>& j, int64_t a, int64_t b) {
  const int64_t tile_bytes = O * j.K * static_cast<int64_t>(sizeof(Wt));  // the weights of one tile of outputs
  const int64_t ahead = std::max<int64_t>(1, (kAheadBytes + tile_bytes - 1) / tile_bytes);  // tiles ahead
  int64_t o = a;
  for (; o + O <= b; o += O) {
    outputs<O, R>(j, o, o + (ahead + 1) * O <= b ? j.w + (o + ahead * O) * j.K : nullptr);
  }
  for (; o < b; ++o) {
    outputs<1, R>(j, o, static_cast<const Wt*>(nullptr));
  }
}
