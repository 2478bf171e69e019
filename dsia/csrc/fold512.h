// The folds of 16 vectors of 16 floats at once with AVX-512 (included by ops.cpp: the attention's scores): lane s of
// the result is the sum of vector s's lanes folded in halves (lane l + lane l+8, then + 4, + 2, + 1), the same
// additions in the same pairs as one vector's fold, so the same bits; the partial sums of two vectors side by side at
// each step.
// Also the same scores computed from the keys laid out dimension-major (keys_by_dim, block16_by_dim), where a task's
// rows and heads are enough to pay for turning each block of 16 keys once.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace casspec {

__attribute__((target("avx512f"), always_inline)) inline __m512 fold16x16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s l + l+8; lanes 8-15: v[2i+1]'s
    const __m512 lo = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44);  // quarters 0 1 | 0 1
    const __m512 hi = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE);  // quarters 2 3 | 2 3
    a[i] = _mm512_add_ps(lo, hi);
  }
  for (int i = 0; i < 4; ++i) {  // quarter q: source 4i + q's l + l+4 (l < 4)
    const __m512 lo = _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88);  // quarters 0 2 | 0 2
    const __m512 hi = _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD);  // quarters 1 3 | 1 3
    b[i] = _mm512_add_ps(lo, hi);
  }
  for (int i = 0; i < 2; ++i) {  // per quarter: [b0 + b2, b1 + b3] of b[2i]'s source, then of b[2i+1]'s
    const __m512 lo = _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44);  // 0 1 | 0 1
    const __m512 hi = _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE);  // 2 3 | 2 3
    c[i] = _mm512_add_ps(lo, hi);
  }
  const __m512 lo = _mm512_shuffle_ps(c[0], c[1], 0x88);  // 0 2 | 0 2
  const __m512 hi = _mm512_shuffle_ps(c[0], c[1], 0xDD);  // 1 3 | 1 3
  // source s = 4p + q sits in lane 4q + p: put it in lane s
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, _mm512_add_ps(lo, hi));
}

// keys [j, j + 16) of a KV head (float32 rows k_stride apart, C chunks of 16 floats), dimension-major: kt[d * 16 + i]
// = key j + i's element d (16x16 transposes by unpacks and shuffles)
template <int64_t C>
__attribute__((target("avx512f"), always_inline)) inline void keys_by_dim(const float* keys, int64_t k_stride,
                                                                          float* kt) {
  for (int64_t c = 0; c < C; ++c) {
    __m512 r[16], a[16], b[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = _mm512_loadu_ps(keys + i * k_stride + c * 16);
    }
    for (int i = 0; i < 8; ++i) {  // per 128-bit quarter L: rows 2i, 2i+1's elements 4L, 4L+1 | 4L+2, 4L+3
      a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // b[4i + k], quarter L: element 4L + k of rows 4i .. 4i+3
      b[4 * i] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
      b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
      b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
      b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {  // element 4L + k of all 16 rows: quarter L of b[k], b[4+k], b[8+k], b[12+k]
      const __m512 even0 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x88);
      const __m512 odd0 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xDD);
      const __m512 even1 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x88);
      const __m512 odd1 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xDD);
      float* d = kt + c * 256;
      _mm512_storeu_ps(d + k * 16, _mm512_shuffle_f32x4(even0, even1, 0x88));
      _mm512_storeu_ps(d + (4 + k) * 16, _mm512_shuffle_f32x4(odd0, odd1, 0x88));
      _mm512_storeu_ps(d + (8 + k) * 16, _mm512_shuffle_f32x4(even0, even1, 0xDD));
      _mm512_storeu_ps(d + (12 + k) * 16, _mm512_shuffle_f32x4(odd0, odd1, 0xDD));
    }
  }
}

// U query heads' scores of 16 keys from their dimension-major copy kt (keys_by_dim): lane i of out[u] is key i's
// score, the same bits as block16's: per key, lane l of its chunk sums e_l = q_l k_l + q_{16+l} k_{16+l} + ... (in
// chunk order), folded l + l+8, then + 4, + 2, + 1, times scale. Here e_l holds lane l for the 16 keys at once, so
// the fold adds whole vectors (no shuffles); lanes l and l+8 go together (their sum kept, 8 registers a head), each
// of kt's vectors loaded once for the U heads.
template <int64_t C, int U>
__attribute__((target("avx512f"), always_inline)) inline void block16_by_dim(const float* const* qh, const float* kt,
                                                                             float scale, float* const* out) {
  __m512 f[U][8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    __m512 lo[U], hi[U];
    const __m512 k0 = _mm512_loadu_ps(kt + l * 16), k8 = _mm512_loadu_ps(kt + (l + 8) * 16);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      lo[u] = _mm512_mul_ps(_mm512_set1_ps(qh[u][l]), k0);
      hi[u] = _mm512_mul_ps(_mm512_set1_ps(qh[u][l + 8]), k8);
    }
#pragma GCC unroll 8
    for (int64_t c = 1; c < C; ++c) {
      const __m512 kl = _mm512_loadu_ps(kt + (c * 16 + l) * 16), kh = _mm512_loadu_ps(kt + (c * 16 + l + 8) * 16);
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        lo[u] = _mm512_add_ps(lo[u], _mm512_mul_ps(_mm512_set1_ps(qh[u][c * 16 + l]), kl));
        hi[u] = _mm512_add_ps(hi[u], _mm512_mul_ps(_mm512_set1_ps(qh[u][c * 16 + l + 8]), kh));
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      f[u][l] = _mm512_add_ps(lo[u], hi[u]);
    }
  }
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) {
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      f[u][l] = _mm512_add_ps(f[u][l], f[u][l + 4]);
    }
    f[u][0] = _mm512_add_ps(f[u][0], f[u][2]);
    f[u][1] = _mm512_add_ps(f[u][1], f[u][3]);
    _mm512_storeu_ps(out[u], _mm512_mul_ps(_mm512_add_ps(f[u][0], f[u][1]), _mm512_set1_ps(scale)));
  }
}

}  // namespace casspec
