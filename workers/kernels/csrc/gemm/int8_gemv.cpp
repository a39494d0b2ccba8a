// kvmesh::int8_linear: y = (x @ q^T) * s for weight-only int8 with one scale per output column
// (the int8 format of workers/layers/quant.py; the lm_head of the int4 and w8a8 formats), at
// the avx512bf16 level and above (isa.h: AVX-512 F, BW, DQ, and AVX512-BF16 for the output
// rounding); none below it (int8_path).
//
// Layout (workers/kernels/gemm.py pack_int8_panels): 16-column panels of 16 K bytes, k-major
// (16 bytes per k: the panel's 16 columns), so that one vpmovsxbd from memory and vcvtdq2ps give
// the 16 weights of a k as float32 (exact), multiplied into float32 accumulators with x[k]
// broadcast (widened from bfloat16 in the broadcast); the column scales (bfloat16, as ATen's
// int8 CPU kernel keeps them) multiply the sums at the end. Threads split the panels; rows go in
// blocks of 128 (their x stays in L2) and 4 at a time per panel. Decode reads 1 byte per
// weight plus a scale per column (the int4 format's lm_head: 28 MB for SmolLM2).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "isa.h"

namespace kvmesh_gemm {
namespace {

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")


// rows [0, MR) of x (bfloat16, row stride K) against one panel -> y (bf16, row stride ldy), 16 columns
template <int MR>
static void int8_panel_rows(const uint16_t* x, int64_t K, const int8_t* panel, const uint16_t* scales, uint16_t* y,
                            int64_t ldy) {
  constexpr int U = MR == 1 ? 4 : MR == 2 ? 2 : 1;     // independent accumulators per row
  __m512 acc[MR][U];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(panel + (k + j) * 16))));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][j % U] = _mm512_fmadd_ps(kvmesh::bf16_bcast16_f32(x[r * K + k + j]), w, acc[r][j % U]);
    }
  }
  for (; k < K; ++k) {
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(panel + k * 16))));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r][0] = _mm512_fmadd_ps(kvmesh::bf16_bcast16_f32(x[r * K + k]), w, acc[r][0]);
  }
  const __m512 sv = kvmesh::bf16x16_f32(scales);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    __m512 a = acc[r][0];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
    _mm256_storeu_si256((__m256i*)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, sv)));
  }
}

#pragma GCC pop_options

static void int8_rows(const uint16_t* x, int64_t K, const int8_t* panel, const uint16_t* scales, uint16_t* y, int64_t ldy,
                      int64_t mr) {
  switch (mr) {
    case 1: int8_panel_rows<1>(x, K, panel, scales, y, ldy); break;
    case 2: int8_panel_rows<2>(x, K, panel, scales, y, ldy); break;
    case 3: int8_panel_rows<3>(x, K, panel, scales, y, ldy); break;
    default: int8_panel_rows<4>(x, K, panel, scales, y, ldy);
  }
}

#endif

// x bf16 [M, K], panels int8 [N16 / 16, 16 K], scales bf16 [N16] -> y bf16 [M, N] (first N of N16)
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(kvmesh::active_isa() >= kvmesh::Isa::kAvx512Bf16, "int8_linear: the kernel ISA in use (",
              kvmesh::isa_name(kvmesh::active_isa()), ") is below avx512bf16, the one level this kernel has");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_linear: x must be bfloat16 [M, K]");
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == at::kChar && panels.is_contiguous(),
              "int8_linear: panels must be contiguous int8 [N16 / 16, 16 K]");
  const int64_t M = x.size(0), K = x.size(1), np = panels.size(0);
  TORCH_CHECK(panels.size(1) == K * 16, "int8_linear: panels hold K = ", panels.size(1) / 16, ", x has ", K);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == np * 16,
              "int8_linear: scales must be contiguous bfloat16 [N16]");
  TORCH_CHECK(n > 0 && n <= np * 16, "int8_linear: N (", n, ") must be in (0, ", np * 16, "]");
  const at::Tensor xc = x.contiguous();
  const uint16_t* xd = (const uint16_t*)xc.data_ptr<at::BFloat16>();
  at::Tensor y = at::empty({M, np * 16}, x.options());
#if defined(__x86_64__)
  const int8_t* pd = panels.data_ptr<int8_t>();
  const uint16_t* sd = (const uint16_t*)scales.data_ptr<at::BFloat16>();
  uint16_t* yd = (uint16_t*)y.data_ptr<at::BFloat16>();
  const int64_t ldy = np * 16;
  constexpr int64_t MC = 128;
  at::parallel_for(0, np, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t mb = 0; mb < M; mb += MC)
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = mb; m < std::min(M, mb + MC); m += 4)
          int8_rows(xd + m * K, K, pd + p * K * 16, sd + p * 16, yd + m * ldy + p * 16, ldy,
                    std::min<int64_t>(4, M - m));
  });
#endif
  return n == np * 16 ? y : y.narrow(1, 0, n);
}

}  // namespace

// The level int8_linear runs at level `isa`: "avx512bf16" (its one, also run at amx), or "none"
// below it (the op raises; the layers then keep ATen's kernel: workers/layers/quant.py).
const char* int8_path(kvmesh::Isa isa) { return isa >= kvmesh::Isa::kAvx512Bf16 ? "avx512bf16" : "none"; }

}  // namespace kvmesh_gemm

TORCH_LIBRARY_FRAGMENT(kvmesh, m) { m.def("int8_linear(Tensor x, Tensor panels, Tensor scales, int N) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("int8_linear", &kvmesh_gemm::int8_linear_cpu); }
