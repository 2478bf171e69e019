// register-only float32 FMA peak: 12 independent 512-bit FMA chains per thread, every thread
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
#include <chrono>
int main() {
  const long iters = 200000000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 a[12], b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
      for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + i);
      for (long it = 0; it < iters / 12; ++it)
        _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
      __m512 s = a[0];
      for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
      sink += _mm512_reduce_add_ps(s);
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double gmac = omp_get_max_threads() * (double)(iters / 12 * 12) * 16 / dt / 1e9;
    if (gmac > best) best = gmac;
    if (sink == 12345) printf("x");
  }
  printf("threads %d: %.1f GMAC/s float32 FMA (register only, best of 5)\n", omp_get_max_threads(), best);
}
