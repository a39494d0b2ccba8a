// bfloat16 <-> float32 by bit manipulation, shared by the elementwise kernels (norm.cpp,
// rotary.cpp, activation.cpp). Inline functions in an anonymous namespace: each translation
// unit gets its own copy, so target_clones / per-function targets may inline them freely.
#pragma once
#include <cstdint>
#include <cstring>

namespace kvmesh {
namespace {

inline float b2f(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2b(float f) {       // round to nearest even, as c10::BFloat16; NaN stays a quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t(nan ? ((u >> 16) | 0x40u) : r);
}

}  // namespace
}  // namespace kvmesh
