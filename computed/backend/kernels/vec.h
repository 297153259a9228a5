// Float vectors for the kernels of this directory (GCC vector extensions, so they build for any
// -march; AVX-512 makes a v16 one register), and exact loads of float32 or bfloat16 bits into them.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace loraplane
