// The vdpbf16ps register tile of both bfloat16 dot-product kernels: the attention kernel's
// (attn_flash.h, DpMul) and the GEMM's for bf16 activations (gemm/micro_avx512.cpp, micro_dp).
// acc is R rows x N vectors of 16 float32 sums; each step multiplies one bfloat16 pair of every
// row (broadcast as one 32-bit lane) into N vectors of 16 column pairs. Always inlined into its
// callers, which must be compiled for AVX512-BF16.
#pragma once
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace kvmesh_dp {

#define KVMESH_DP_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

template <int R, int N>
KVMESH_DP_INLINE void zero(__m512 (&acc)[R][N]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
}

// acc[r][n] += the pair at a + r * lda (bytes) . b[n], for r < R and n < N
template <int R, int N>
KVMESH_DP_INLINE void step(__m512 (&acc)[R][N], const void* a, int64_t lda, const __m512bh (&b)[N]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    std::memcpy(&pair, static_cast<const char*>(a) + r * lda, sizeof pair);
    const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], av, b[n]);
  }
}

#undef KVMESH_DP_INLINE

}  // namespace kvmesh_dp
