#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
// The AVX-512 loop of kvmesh::silu_and_mul_bf16 (activation.cpp), with the attention kernel's
// AVX-512 traits (isa_traits.h: exp, bfloat16 loads). Compiled for baseline x86-64 plus the
// target above; only called after a run-time CPU feature check. No torch headers (see
// attn_args.h).
#if defined(__x86_64__)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "bf16.h"

#define KVMESH_ISA 2
namespace kvmesh {
namespace act_avx512 {
#include "isa_traits.h"

// round to nearest even (finite or +-inf inputs), as f32_bf16
inline __m512i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
}
}  // namespace act_avx512

// o[i] = bf16(bf16(silu(g[i])) * u[i]) for i < n (n a multiple of 16 handled here; returns how
// many were done, the caller finishes the tail)
int64_t silu_mul_avx512(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
  using act_avx512::Simd;
  using act_avx512::round_bf16;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = Simd::cvt_bf16(g + i);
    __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), Simd::exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    // below -88.7 exp(-x) is +inf in float32 (std::exp), silu -0; Simd::exp stops at 2^127
    s = _mm512_mask_mul_ps(s, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.72283f), _CMP_LT_OQ), x, _mm512_setzero_ps());
    const __m512 sb = _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(s), 16));
    _mm256_storeu_si256((__m256i*)(o + i), _mm512_cvtepi32_epi16(round_bf16(_mm512_mul_ps(sb, Simd::cvt_bf16(u + i)))));
  }
  return i;
}
}  // namespace kvmesh
#endif
