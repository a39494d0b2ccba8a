// Portable micro-kernels (any CPU): the reference the SIMD paths are tested against, and the
// path used when the CPU has no AVX2+FMA. Plain loops over the packed layout of micro.h; the
// compiler may auto-vectorise them with the baseline ISA (SSE2 on x86-64).
#include <cstring>

#include "bf16.h"
#include "micro.h"

namespace kvmesh_gemm {
namespace {

template <int MR, int NP>
void micro_scalar(const float* x, int64_t ldx, const uint16_t* w, int64_t pstride, int64_t kp,
                  float* tile) {
  constexpr int NC = NP * kPanel;
  float acc[MR][NC] = {};
  for (int64_t t = 0; t < kp; ++t) {
    for (int p = 0; p < NP; ++p) {
      const uint16_t* row = w + p * pstride + t * 2 * kPanel;
      float w0[kPanel], w1[kPanel];
      for (int c = 0; c < kPanel; ++c) {
        w0[c] = kvmesh::bf16_f32(row[2 * c]);
        w1[c] = kvmesh::bf16_f32(row[2 * c + 1]);
      }
      for (int m = 0; m < MR; ++m) {
        const float a0 = x[m * ldx + 2 * t], a1 = x[m * ldx + 2 * t + 1];
        for (int c = 0; c < kPanel; ++c) acc[m][p * kPanel + c] += a0 * w0[c] + a1 * w1[c];
      }
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(tile + m * NC, acc[m], sizeof acc[m]);
}

struct Kernels {
  template <int MR, int NP>
  static constexpr MicroFn fn() { return &micro_scalar<MR, NP>; }
};

}  // namespace

const MicroTable& scalar_table() {
  static const MicroTable t = make_table<Kernels, 4>("scalar");
  return t;
}

}  // namespace kvmesh_gemm
