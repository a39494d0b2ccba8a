// bfloat16 <-> float32, written once for every kernel. bfloat16 is the upper half of a float32,
// so widening is a 16-bit shift (exact); narrowing rounds to nearest even, as c10::BFloat16
// does, a NaN staying a quiet NaN.
//
// Everything is inline in an anonymous namespace: each translation unit gets its own copy,
// compiled for that unit's target (the per-level units are compiled under `#pragma GCC target`),
// so no copy compiled for AVX-512 can be picked by the linker for baseline callers. The vector
// forms carry the smallest target they need and are always inlined, so they can be called
// from code compiled for that target or any wider one. No torch header here (the micro-kernel
// and per-level units include none).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvmesh {
namespace {

inline float bf16_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Branch-free, so that loops calling it vectorise.
inline uint16_t f32_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t(nan ? ((u >> 16) | 0x40u) : r);
}

#if defined(__x86_64__)
#define KVMESH_BF16_VEC(isa) __attribute__((target(isa), always_inline)) inline

// 8 bfloat16 at p -> 8 float32
KVMESH_BF16_VEC("avx2") __m256 bf16x8_f32(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// 16 bfloat16 (in a 256-bit vector, or at p) -> 16 float32
KVMESH_BF16_VEC("avx512f") __m512 bf16x16_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
KVMESH_BF16_VEC("avx512f") __m512 bf16x16_f32(const uint16_t* p) {
  return bf16x16_f32(_mm256_loadu_si256((const __m256i*)p));
}

// one bfloat16 -> float32 in all 16 lanes
KVMESH_BF16_VEC("avx512f") __m512 bf16_bcast16_f32(uint16_t h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi32(h), 16));
}

#undef KVMESH_BF16_VEC
#endif

}  // namespace
}  // namespace kvmesh
