// AVX2+FMA micro-kernels (8 fp32 lanes; a 16-column panel row is two ymm per k).
//
// Compiled with the project's baseline flags: only the functions below carry
// __attribute__((target("avx2,fma"))), so one build runs on any x86-64 and the dispatcher
// (gemm_ops.cpp) calls them only at the avx2 level or above (isa.h). This file includes no
// torch header, so no inline library function can be instantiated with AVX2 code and picked
// by the linker for baseline callers.
//
// Blocking: MR = 5 rows x 1 panel (10 ymm accumulators + 2 weights + 1 broadcast + 1 mask of
// the 16 registers). BLIS' Haswell SGEMM uses 6x16, but with the widening mask and GCC's
// allocation 6 rows spill accumulators (figures: docs/engine.md, "Kernel constants and the measurements behind them"). For MR <= 2 two
// panels per call (8 accumulators with the k-split at MR = 1).
#if defined(__x86_64__)
#include <immintrin.h>

#include "micro.h"

namespace kvmesh_gemm {
namespace {

#define KV_TARGET __attribute__((target("avx2,fma")))
#define KV_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

#define KV_BITS 256
#include "micro_simd.h"

#undef KV_BITS
#undef KV_INLINE
#undef KV_TARGET

// Two panels as two one-panel calls from MR = 4 up (see the file comment).
struct Kernels {
  template <int MR, int NP>
  static constexpr MicroFn fn() {
    if constexpr (NP == 2 && MR >= 4) return &micro_split<MR>;
    else return &micro<MR, NP>;
  }
};

}  // namespace

const MicroTable& avx2_table() {
  static const MicroTable t = make_table<Kernels, 5>("avx2");
  return t;
}

}  // namespace kvmesh_gemm

#endif  // __x86_64__
