// AVX-512F micro-kernels (16 fp32 lanes: a panel row is one zmm per k) and, for bf16
// activations on CPUs with AVX512-BF16, vdpbf16ps kernels that consume the packed pairs as
// they are (the layout of micro.h is the "VNNI-2" layout that instruction expects).
//
// Per-function target attributes, no torch headers: see micro_avx2.cpp. Blocking: up to
// MR = 8 rows x 2 panels (16 zmm accumulators of 32; BLIS' SkylakeX kernel uses 14x32 with
// the same broadcast-A / vector-B scheme).
//
// NOTE: the development machine of this kernel had no AVX-512; these kernels are exercised by
// tests/test_gemm_kernel.py only where the CPU supports them.
#if defined(__x86_64__)
#include <immintrin.h>

#include "../dp_tile.h"
#include "micro.h"

namespace kvmesh_gemm {
namespace {

#define KV_TARGET __attribute__((target("avx512f,avx2,fma")))
#define KV_INLINE static inline __attribute__((always_inline, target("avx512f,avx2,fma")))

#define KV_BITS 512
#include "micro_simd.h"

#undef KV_BITS
#undef KV_INLINE
#undef KV_TARGET

// bf16 activations: acc[m][p] += sum_j x[m][2t + j] * W_p[t][c][j] in one vdpbf16ps per
// (row, panel, k-pair); x's pair is broadcast as one 32-bit lane.
#define KV_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))
template <int MR, int NP>
KV_TARGET void micro_dp(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w,
                        int64_t pstride, int64_t kp, float* __restrict tile) {
  __m512 acc[MR][NP];
  kvmesh_dp::zero(acc);
  for (int64_t t = 0; t < kp; ++t) {
    const uint16_t* row = w + t * 2 * kPanel;
    __m512bh wv[NP];
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(row + p * pstride + 8 * 2 * kPanel), _MM_HINT_T0);
      wv[p] = (__m512bh)_mm512_loadu_si512(row + p * pstride);
    }
    kvmesh_dp::step(acc, x + 2 * t, 2 * ldx, wv);      // ldx in uint16, the step's in bytes
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(tile + m * NP * kPanel + p * kPanel, acc[m][p]);
}
#undef KV_TARGET

struct F32Kernels {
  template <int MR, int NP>
  static constexpr MicroFn fn() { return &micro<MR, NP>; }
};
struct Bf16Kernels {
  template <int MR, int NP>
  static constexpr MicroBf16Fn fn() { return &micro_dp<MR, NP>; }
};

struct Tables {
  MicroTable f32 = make_table<F32Kernels, kMaxMR>("avx512");
  MicroBf16Table bf16{kMaxMR, {}};
  Tables() { fill_table<Bf16Kernels, kMaxMR>(bf16); }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

const MicroTable& avx512_table() { return tables().f32; }
const MicroBf16Table& avx512bf16_table() { return tables().bf16; }

}  // namespace kvmesh_gemm

#endif  // __x86_64__
