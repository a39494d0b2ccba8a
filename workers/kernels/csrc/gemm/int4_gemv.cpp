// kvmesh::int4_linear: y = x @ W^T for group-wise asymmetric int4 weights, W = (q - 8) * s + z
// per group of G consecutive k (the canonical int4 format of workers/layers/quant.py), at the
// avx512bf16 level and above (isa.h; vdpbf16ps), none below it (int4_path): decode steps and
// prefill chunks alike.
//
// Layout (made by workers/kernels/gemm.py pack_int4_panels): 16-column panels of 8 K bytes; per
// panel, K/8 groups of 64 bytes = 32 16-bit lanes, lane 2n + j (column n, j in {0, 1}) of k-octet
// o holding q[n][8o + 2s + j] in its nibble s (bits 4s..4s+3), so that a shift and one
// vpternlogd give the bfloat16 pair vector of k pair 4o + s ((a & 0xF) | 0x4300: the bfloat16
// 128 + q, exact) that vdpbf16ps multiplies with a broadcast (x[k], x[k+1]) -- the "VNNI-2" pair
// layout of the bf16 GEMM (micro.h), at 4 bits, with no shuffles. Scales and zeros: bfloat16
// [panels, K/G, 2, 16] (s, z), as ATen's int4 CPU kernel keeps them.
//
// Per panel, row and group: acc = sum_k x_k (128 + q_k) (vdpbf16ps, float32), then
// y += s * acc + (z - 136 s) * sum_k x_k (= sum_k x_k ((q_k - 8) s + z)). Threads split the
// panels; rows are taken in blocks of 128 (their x stays in L2 across a thread's panels) and,
// within a block, 8 at a time per panel (8 K/2 bytes + the scales, 5.8 KB for K = 576, in L1).
// Decode is bound by reading the weights: 4.5 bits per weight instead of bf16's 16. No software
// prefetch: the panels are read in order, which the hardware prefetchers follow
// (figures: docs/engine.md, "Kernel constants and the measurements behind them").
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "isa.h"

namespace kvmesh_gemm {
namespace {

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512dq")

using kvmesh::bf16x16_f32;

// rows [m0, m0 + MR) of x (bf16 [M, K]) against panel p: y rows (bf16 [M, N16]) columns 16p..16p+15
template <int MR>
static void int4_panel_rows(const uint16_t* x, int64_t K, const float* xsum, int64_t ngroups, const uint8_t* panel,
                            const uint16_t* sz, int G, uint16_t* y, int64_t ldy) {
  const __m512i lo4 = _mm512_set1_epi16(0x0F), b128 = _mm512_set1_epi16(0x4300);   // bf16 128.0
  const __m512 m136 = _mm512_set1_ps(-136.f);
  const uint32_t* xp = (const uint32_t*)x;      // (x[k], x[k + 1]) pairs
  const int64_t kp = K / 2;
  __m512 out[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) out[r] = _mm512_setzero_ps();
  const int octets = G / 8;
  // U independent accumulators per row, so that a row's vdpbf16ps do not wait on each other
  constexpr int U = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  for (int64_t g = 0; g < ngroups; ++g) {
    __m512 acc[MR][U];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    const uint8_t* pg = panel + g * octets * 64;
    const int64_t k2 = g * G / 2;               // first k pair of the group
#pragma GCC unroll 2
    for (int o = 0; o < octets; ++o) {
      const __m512i v = _mm512_loadu_si512(pg + o * 64);
#pragma GCC unroll 4
      for (int sh = 0; sh < 4; ++sh) {
        // nibble sh of every 16-bit lane, as the bfloat16 128 + q (0x4300 | q: exact); imm 0xEA: (a & b) | c
        const __m512i nib = sh == 0 ? v : _mm512_srli_epi16(v, 4 * sh);
        const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(nib, lo4, b128, 0xEA);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int u = sh % U;
          acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)_mm512_set1_epi32((int)xp[r * kp + k2 + 4 * o + sh]), w);
        }
      }
    }
    // sum x (q - 8) s + z = s * sum x (128 + q) + (z - 136 s) * sum x
    const uint16_t* s = sz + g * 32;
    const __m512 sv = bf16x16_f32(s), zv = bf16x16_f32(s + 16);
    const __m512 cv = _mm512_fmadd_ps(m136, sv, zv);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512 a = acc[r][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
      out[r] = _mm512_fmadd_ps(a, sv, out[r]);
      out[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * ngroups + g]), cv, out[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) _mm256_storeu_si256((__m256i*)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(out[r]));
}

template <int MR>
static void rows_block(const uint16_t* x, int64_t K, const float* xsum, int64_t ngroups, const uint8_t* pan,
                       const uint16_t* s, int G, uint16_t* y, int64_t ldy, int64_t mr) {
  if constexpr (MR > 1) {
    if (mr < MR) return rows_block<MR - 1>(x, K, xsum, ngroups, pan, s, G, y, ldy, mr);
  }
  int4_panel_rows<MR>(x, K, xsum, ngroups, pan, s, G, y, ldy);
}

static void int4_gemv_avx512bf16(const uint16_t* x, int64_t M, int64_t K, const float* xsum, const uint8_t* panels,
                                 const uint16_t* sz, int64_t npanels, int G, uint16_t* y) {
  const int64_t ngroups = K / G, ldy = npanels * 16;
  const int64_t panel_bytes = K * 8, sz_elems = ngroups * 32;
  constexpr int64_t MC = 128;     // rows per block: their x (MC x K bf16) stays in L2 across a thread's panels
  at::parallel_for(0, npanels, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t mb = 0; mb < M; mb += MC)
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = mb; m < std::min(M, mb + MC); m += 8)
          rows_block<8>(x + m * K, K, xsum + m * ngroups, ngroups, panels + p * panel_bytes, sz + p * sz_elems, G,
                        y + m * ldy + p * 16, ldy, std::min<int64_t>(8, M - m));
  });
}

// x * scale rounded to bfloat16 into xs when scale is given (vcvtneps2bf16: round to nearest
// even, as ATen's bf16 product, for all but denormal products, which it flushes to zero), and
// each row's sums of the (scaled) x over its groups into xsum [M, K / G] (G % 16 == 0); rows
// split among threads
static void int4_prepare(const uint16_t* x, int64_t M, int64_t K, int G, const uint16_t* scale, uint16_t* xs,
                         float* xsum) {
  const int64_t ng = K / G;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t base = m * K + g * G;
        __m512 acc = _mm512_setzero_ps();
        for (int k = 0; k < G; k += 16) {
          __m512 v = bf16x16_f32(x + base + k);
          if (scale != nullptr) {
            const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, bf16x16_f32(scale + g * G + k)));
            _mm256_storeu_si256((__m256i*)(xs + base + k), r);
            v = bf16x16_f32(r);
          }
          acc = _mm512_add_ps(acc, v);
        }
        xsum[m * ng + g] = _mm512_reduce_add_ps(acc);
      }
  });
}

#pragma GCC pop_options

#endif

// x bf16 [M, K] (K % G == 0, G % 16 == 0), panels uint8 [N16 / 16, 8 K], sz bf16 [N16 / 16, K / G, 2, 16],
// input_scale bf16 [K] or none (x * input_scale rounded to bf16 first, as the bf16 product in
// ATen) -> y bf16 [M, N] (the first N of the N16 columns)
at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& sz, int64_t group_size,
                           int64_t n, const std::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(kvmesh::active_isa() >= kvmesh::Isa::kAvx512Bf16, "int4_linear: the kernel ISA in use (",
              kvmesh::isa_name(kvmesh::active_isa()), ") is below avx512bf16, the one level this kernel has");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int4_linear: x must be bfloat16 [M, K]");
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == at::kByte && panels.is_contiguous(),
              "int4_linear: panels must be contiguous uint8 [N16 / 16, 8 K]");
  const int64_t M = x.size(0), K = x.size(1), G = group_size, np = panels.size(0);
  TORCH_CHECK(G > 0 && G % 16 == 0 && K % G == 0, "int4_linear: K (", K, ") must be a multiple of the group size (",
              G, "), itself a multiple of 16");
  TORCH_CHECK(panels.size(1) == K * 8, "int4_linear: panels hold K = ", panels.size(1) / 8, ", x has ", K);
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 4 && sz.size(0) == np &&
                  sz.size(1) == K / G && sz.size(2) == 2 && sz.size(3) == 16,
              "int4_linear: scales and zeros must be contiguous bfloat16 [N16 / 16, K / G, 2, 16]");
  TORCH_CHECK(n > 0 && n <= np * 16, "int4_linear: N (", n, ") must be in (0, ", np * 16, "]");
  const at::Tensor xc = x.contiguous();
  const uint16_t* xd = (const uint16_t*)xc.data_ptr<at::BFloat16>();
  const uint16_t* sd = nullptr;
  std::vector<uint16_t> scaled;
  if (input_scale.has_value()) {
    const at::Tensor& is = *input_scale;
    TORCH_CHECK(is.scalar_type() == at::kBFloat16 && is.is_contiguous() && is.numel() == K,
                "int4_linear: input_scale must be contiguous bfloat16 [K]");
    sd = (const uint16_t*)is.data_ptr<at::BFloat16>();
    scaled.resize(M * K);
  }
  std::vector<float> xsum(M * (K / G));     // float32 [M, K / G]
  at::Tensor y = at::empty({M, np * 16}, x.options());
#if defined(__x86_64__)
  int4_prepare(xd, M, K, (int)G, sd, scaled.data(), xsum.data());
  if (sd != nullptr) xd = scaled.data();
  int4_gemv_avx512bf16(xd, M, K, xsum.data(),
                       panels.data_ptr<uint8_t>(), (const uint16_t*)sz.data_ptr<at::BFloat16>(), np, (int)G,
                       (uint16_t*)y.data_ptr<at::BFloat16>());
#endif
  return n == np * 16 ? y : y.narrow(1, 0, n);
}

}  // namespace

// The level int4_linear runs at level `isa`: "avx512bf16" (its one, also run at amx), or "none"
// below it (the op raises; the layers then keep ATen's kernel: workers/layers/quant.py).
const char* int4_path(kvmesh::Isa isa) { return isa >= kvmesh::Isa::kAvx512Bf16 ? "avx512bf16" : "none"; }

}  // namespace kvmesh_gemm

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("int4_linear(Tensor x, Tensor panels, Tensor scales_and_zeros, int group_size, int N, "
        "Tensor? input_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("int4_linear", &kvmesh_gemm::int4_linear_cpu); }
