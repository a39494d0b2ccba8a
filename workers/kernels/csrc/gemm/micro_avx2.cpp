// AVX2+FMA micro-kernels (8 fp32 lanes; a 16-column panel row is two ymm per k).
//
// Compiled with the project's baseline flags: only the functions below carry
// __attribute__((target("avx2,fma"))), so one build runs on any x86-64 and the dispatcher
// (gemm_ops.cpp) calls them only when __builtin_cpu_supports says so. This file includes no
// torch header, so no inline library function can be instantiated with AVX2 code and picked
// by the linker for baseline callers.
//
// Blocking: MR = 5 rows x 1 panel (10 ymm accumulators + 2 weights + 1 broadcast + 1 mask of
// the 16 registers). BLIS' Haswell SGEMM uses 6x16, but with the widening mask and GCC's
// allocation 6 rows spill accumulators; measured on Zen 3 (1 thread, SmolLM2 chain, M=256):
// MR=5 83 GFLOP/s, MR=6 63, MR=4 ~75. For MR <= 2 two panels per call (8 accumulators with
// the k-split at MR = 1).
#if defined(__x86_64__)
#include <immintrin.h>

#include "micro.h"

namespace kvmesh_gemm {
namespace {

#define KV_TARGET __attribute__((target("avx2,fma")))
#define KV_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

struct Ops {
  using V = __m256;
  using VI = __m256i;
  static constexpr int L = 8;
  KV_INLINE V zero() { return _mm256_setzero_ps(); }
  KV_INLINE V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  KV_INLINE VI load(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  KV_INLINE V lo(VI r) { return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)); }
  KV_INLINE V hi(VI r) { return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))); }
  KV_INLINE V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  KV_INLINE V add(V a, V b) { return _mm256_add_ps(a, b); }
  KV_INLINE void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  KV_INLINE void prefetch(const uint16_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
};

#include "micro_simd.h"

#undef KV_INLINE
#undef KV_TARGET

MicroTable make() {
  MicroTable t{"avx2", 5, {}};
  t.fn[1][1] = &micro<1, 1>; t.fn[1][2] = &micro<1, 2>;
  t.fn[2][1] = &micro<2, 1>; t.fn[2][2] = &micro<2, 2>;
  t.fn[3][1] = &micro<3, 1>; t.fn[3][2] = &micro<3, 2>;
  t.fn[4][1] = &micro<4, 1>; t.fn[4][2] = &micro_split<4>;
  t.fn[5][1] = &micro<5, 1>; t.fn[5][2] = &micro_split<5>;
  return t;
}

}  // namespace

const MicroTable& avx2_table() {
  static const MicroTable t = make();
  return t;
}

}  // namespace kvmesh_gemm

#endif  // __x86_64__
