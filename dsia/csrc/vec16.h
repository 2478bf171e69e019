// Sixteen floats as one vector (GCC's vector extensions: one AVX-512 register, two AVX2 ones, or sixteen scalars,
// whichever the calling function is built for), and the few things done with them by more than one file: loads and
// stores of a row's 16-float chunks (a short tail through the same lanes), fixed-order folds of the lanes (their sum,
// their largest), and e^x.
// Included by ops.cpp (a forward's small steps), rowtop.cpp (a row's top k and log-sum-exp) and blockq.cpp (its
// activations' quantization). Every function is inlined into its caller, so each instruction set's path of the caller
// gets its own code.
#pragma once

#include <cstdint>
#include <cstring>

namespace casspec {

constexpr int64_t kLanes = 16;
typedef float v16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads and stores
typedef int32_t i16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));  // 16 bfloat16 values' bits
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4)));

[[gnu::always_inline]] inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// the n <= 16 floats at p, zeros after them (a row's tail goes through the same lanes as the rest)
[[gnu::always_inline]] inline v16 load(const float* p, int64_t n) {
  if (n == kLanes) {
    return load(p);
  }
  v16 v = {};
  for (int64_t i = 0; i < n; ++i) {
    v[i] = p[i];
  }
  return v;
}

// the n <= 16 bfloat16 values (their bits) at p, widened exactly to float32 (the bits as a float's upper half),
// zeros after them (16 in one load: widening them one by one was a quarter of a bfloat16 16-token forward)
[[gnu::always_inline]] inline v16 load(const uint16_t* p, int64_t n) {
  u16x16 bits = {};
  std::memcpy(&bits, p, sizeof(uint16_t) * n);
  const u32x16 wide = __builtin_convertvector(bits, u32x16) << 16;
  return reinterpret_cast<const v16&>(wide);
}

[[gnu::always_inline]] inline void store(float* p, v16 v, int64_t n = kLanes) {
  if (n == kLanes) {
    std::memcpy(p, &v, sizeof(v));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    p[i] = v[i];
  }
}

// a fold in halves: lane i + 8 over lane i, then + 4, + 2, + 1
constexpr i16 kHalf8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
constexpr i16 kHalf4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
constexpr i16 kHalf2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
constexpr i16 kHalf1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};

// the lanes' sum, folded in halves: lane i + lane i + 8, then + 4, + 2, + 1
[[gnu::always_inline]] inline float fold(v16 v) {
  v = v + __builtin_shuffle(v, kHalf8);
  v = v + __builtin_shuffle(v, kHalf4);
  v = v + __builtin_shuffle(v, kHalf2);
  v = v + __builtin_shuffle(v, kHalf1);
  return v[0];
}

// the integer lanes' sum, folded the same way (exact in any order: wrapping sums)
[[gnu::always_inline]] inline int32_t fold(i16 v) {
  v += __builtin_shuffle(v, kHalf8);
  v += __builtin_shuffle(v, kHalf4);
  v += __builtin_shuffle(v, kHalf2);
  v += __builtin_shuffle(v, kHalf1);
  return v[0];
}

// the largest lane, folded the same way; for lanes that are none NaN (then exact in any order)
[[gnu::always_inline]] inline float fold_max(v16 v) {
  v = v > __builtin_shuffle(v, kHalf8) ? v : __builtin_shuffle(v, kHalf8);
  v = v > __builtin_shuffle(v, kHalf4) ? v : __builtin_shuffle(v, kHalf4);
  v = v > __builtin_shuffle(v, kHalf2) ? v : __builtin_shuffle(v, kHalf2);
  v = v > __builtin_shuffle(v, kHalf1) ? v : __builtin_shuffle(v, kHalf1);
  return v[0];
}

// e^x in every lane (Cephes' expf: x = n ln 2 + r, a degree-7 polynomial in r, times 2^n); 0 below -87.3
[[gnu::always_inline]] inline v16 vexp(v16 x) {
  const v16 big = v16{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  v16 n = (x * 1.44269504088896341f + big) - big;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  i16 ni = __builtin_convertvector(n, i16);
  i16 bits = (ni + 127) << 23;
  v16 scaled = p * reinterpret_cast<v16&>(bits);
  i16 under = x < -87.3f;  // -1 where e^x is below float's normal range
  i16 kept = reinterpret_cast<i16&>(scaled) & ~under;
  return reinterpret_cast<v16&>(kept);
}

}  // namespace casspec
