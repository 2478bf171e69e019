// The folds of 16 vectors of 16 floats at once with AVX-512 (included by ops.cpp: the attention's scores): lane s of
// the result is the sum of vector s's lanes folded in halves (lane l + lane l+8, then + 4, + 2, + 1), the same
// additions in the same pairs as one vector's fold, so the same bits; the partial sums of two vectors side by side at
// each step.
#pragma once

#include <immintrin.h>

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

}  // namespace casspec
