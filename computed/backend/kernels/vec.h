// Float vectors for the kernels of this directory (GCC vector extensions, so they build for any
// -march; AVX-512 makes a v16 one register), exact loads of float32 or bfloat16 bits into them, the
// build's native width (Vec) and fused multiply-adds.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__FMA__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace loraplane {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
// bfloat16 bits and their widened form, lane for lane with a vector of floats
template <typename V>
struct Bits;
template <>
struct Bits<v8> {
  typedef uint16_t H __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(32)));
};
template <>
struct Bits<v16> {
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
};

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bfloat16 bits -> float32, exact
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// V (a vector of floats) from float32 values, or from bfloat16 bits, widened exactly
template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
inline V load(const uint16_t* p) {
  typedef typename Bits<V>::H H;
  typedef typename Bits<V>::U U;
  H h;
  std::memcpy(&h, p, sizeof h);
  const U u = __builtin_convertvector(h, U) << 16;
  V v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// a * b + c, fused (one rounding) where the CPU has FMA, else as two operations; explicit, so each
// sum keeps one order whatever the compiler contracts (the kernels build with -ffp-contract=off)
inline v8 fmadd(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else  // two halves, each a register of AVX2's
  const v8 lo = fmadd(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                      __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                      __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const v8 hi = fmadd(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                      __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                      __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

// The build's native vector, one register: 16 lanes on AVX-512, 8 elsewhere (AVX2). Blocks of
// accumulators are sized in it, so they fit the registers each ISA has (AVX2's 16 ymm: a v16 there
// is two, and blocks sized for AVX-512's 32 zmm spilled).
#if defined(__AVX512F__)
typedef v16 Vec;
constexpr int kLanes = 16;
#else
typedef v8 Vec;
constexpr int kLanes = 8;
#endif

}  // namespace loraplane
