// kvmesh::pack_bf16_weight / kvmesh::bf16_linear: y = x @ W^T (+ b) with W stored as bf16 in
// the panel layout of micro.h, fp32 accumulation, for CPUs where ATen's bf16 matmul is slow
// (no AVX512-BF16 / AMX: oneDNN falls back to a reference path).
//
// Structure (GotoBLAS / BLIS, Goto & van de Geijn TOMS 2008): the output is cut into tasks of
// MC rows x 32 columns (two 16-column panels), contiguous task ranges go to threads
// (at::parallel_for), and each thread loops k-blocks (KC) outside its panel groups so that its
// MC x KC slice of x stays in L2 while the KC x 32 weight slice of a group stays in L1 across
// the MR-row blocks of the micro-kernel. While a task's x slice (MC x K fp32) fits in L2 -- always
// at decode sizes -- the whole K is one block and each thread streams its contiguous share of
// the packed weight once (decode is bandwidth-bound).
// The micro-kernel (micro_*.cpp) is the active level's (isa.h), every level has its own: scalar,
// avx2, avx512 (fp32 activations at avx512 and above), avx512bf16 (vdpbf16ps, bf16 activations),
// amx (bf16 activations of at least kAmxMinRows rows through AMX tiles, micro_amx.cpp: row blocks
// of 16 or 32 rows, the rows past the last whole 16-row tile read from a zero-padded copy of
// them; row chunks of up to kAmxXBytes of x with all of K, so that a panel group's weights
// serve a whole chunk's row blocks; fewer rows: avx512bf16).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "isa.h"
#include "micro.h"

namespace kvmesh_gemm {
namespace {

using kvmesh::Isa;

const MicroTable& table_for(Isa isa) {
#if defined(__x86_64__)
  if (isa >= Isa::kAvx512) return avx512_table();
  if (isa == Isa::kAvx2) return avx2_table();
#endif
  (void)isa;
  return scalar_table();
}

// Blocking of the fp32 path: task rows and k-block depth chosen by measurement
// (figures: docs/engine.md, "Kernel constants and the measurements behind them").
constexpr int64_t kMC = 60;            // most rows per task (chunks are made equal)
constexpr int64_t kKCP = 256;          // k-pairs per k-block when x's slice needs blocking
constexpr int64_t kXSlice = 256 << 10; // bytes of fp32 x a task may touch without k-blocking
constexpr int64_t kMinWork = 1 << 16;   // multiply-adds below which a thread is not worth it
// Fewest rows of bf16 activations that take the AMX tiles (below, vdpbf16ps: a tile row block
// of 16 would mostly multiply padding) (figures: docs/engine.md, "Kernel constants and the measurements behind them").
constexpr int64_t kAmxMinRows = 4;

struct Problem {
  int64_t M, N, NB, kp;          // rows, columns, panels, k-pairs (Kp / 2)
  const float* x;                // fp32 activations [M, 2 kp] (fp32 micro-kernels)
  const uint16_t* xb;            // bf16 activations [M, 2 kp] (vdpbf16ps kernels) or null;
                                 // AMX: [16 ceil(M / 16), 2 kp], padding rows readable, unless
  const uint16_t* xb_tail;       // AMX: rows [M16, M) of x, zero-padded to [16, 2 kp], or null
  int64_t M16;                   // rows of whole 16-row tiles (M rounded down to 16)
  const uint16_t* w;             // packed [NB][kp][16][2]
  const float* bias;             // [N] or null
  float* out_f;                  // fp32 output [M, N] or null
  c10::BFloat16* out_b;          // bf16 output [M, N] or null
  float* acc;                    // fp32 partial sums [M, N] (bf16 output, several k-blocks)
  bool amx;                      // bf16 row blocks go through the AMX tiles
};

// Adds / writes one micro-tile (mr rows, nc valid columns, row stride ldt) into the output.
// vec: the CPU has AVX512-BF16 (bf16 outputs then take store_tile_bf16's vector loop: the
// scalar loop below cost more than the AMX multiplies at prefill sizes).
void epilogue(const Problem& P, const float* tile, int ldt, int64_t r0, int mr, int64_t c0,
              int nc, bool first, bool last, bool vec) {
#if defined(__x86_64__)
  if (vec && P.out_b != nullptr) {
    store_tile_bf16(tile, ldt, mr, nc, P.bias ? P.bias + c0 : nullptr,
                    P.acc ? P.acc + r0 * P.N + c0 : nullptr, P.N, first, last,
                    reinterpret_cast<uint16_t*>(P.out_b + r0 * P.N + c0), P.N);
    return;
  }
#endif
  for (int i = 0; i < mr; ++i) {
    const float* t = tile + i * ldt;
    const int64_t off = (r0 + i) * P.N + c0;
    const float* b = P.bias ? P.bias + c0 : nullptr;
    float* c = P.out_f ? P.out_f + off : (P.acc ? P.acc + off : nullptr);
    if (c != nullptr) {
      if (first) {
        for (int j = 0; j < nc; ++j) c[j] = t[j] + (b ? b[j] : 0.f);
      } else {
        for (int j = 0; j < nc; ++j) c[j] += t[j];
      }
      if (last && P.out_b)
        for (int j = 0; j < nc; ++j) P.out_b[off + j] = c10::BFloat16(c[j]);
    } else {  // bf16 output, single k-block
      for (int j = 0; j < nc; ++j) P.out_b[off + j] = c10::BFloat16(t[j] + (b ? b[j] : 0.f));
    }
  }
}

void run(const Problem& P, Isa isa, int64_t MC, int64_t KCP) {
  const MicroTable& table = table_for(isa);
#if defined(__x86_64__)
  const MicroBf16Table* dp = (isa >= Isa::kAvx512Bf16 && P.xb) ? &avx512bf16_table() : nullptr;
  const AmxTable* amx = P.amx ? &amx_table() : nullptr;
  const bool vec = isa >= Isa::kAvx512Bf16;
#else
  const MicroBf16Table* dp = nullptr;
#endif
  const int mr_max = dp ? dp->mr_max : table.mr_max;
  const int64_t groups = (P.NB + kGroup - 1) / kGroup;
  const int64_t m_chunks = (P.M + MC - 1) / MC;
  const int64_t pstride = P.kp * 2 * kPanel;
  const int64_t work = std::min(MC, P.M) * P.kp * 2 * kGroup * kPanel;
  const int64_t grain = std::max<int64_t>(1, (kMinWork + work - 1) / work);
  const int64_t ldx = 2 * P.kp;

  at::parallel_for(0, m_chunks * groups, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float tile[32 * kGroup * kPanel];
#if defined(__x86_64__)
    if (amx) amx_configure();
#endif
    for (int64_t t = begin; t < end;) {
      const int64_t mc = t / groups, g0 = t % groups;
      const int64_t g1 = std::min(groups, g0 + (end - t));
      const int64_t r0 = mc * MC, r1 = std::min(P.M, r0 + MC);
      for (int64_t k0 = 0; k0 < P.kp; k0 += KCP) {
        const int64_t kn = std::min(KCP, P.kp - k0);
        const bool first = k0 == 0, last = k0 + kn == P.kp;
        for (int64_t g = g0; g < g1; ++g) {
          const int np = static_cast<int>(std::min<int64_t>(kGroup, P.NB - g * kGroup));
          const int64_t c0 = g * kGroup * kPanel;
          const int nc = static_cast<int>(std::min<int64_t>(np * kPanel, P.N - c0));
          const uint16_t* wg = P.w + g * kGroup * pstride + k0 * 2 * kPanel;
          if (amx) {   // blocks of 32 rows (16 for the last <= 16); r0 is a multiple of 16
            amx_row_blocks(P.xb + 2 * k0, ldx, P.xb_tail ? P.xb_tail + 2 * k0 : nullptr, P.M16, P.M, r0, r1,
                           [&](const uint16_t* a, int mb, int64_t r, int rows) {
                             amx->fn[mb][np](a, ldx, wg, pstride, kn, tile);
                             epilogue(P, tile, np * kPanel, r, rows, c0, nc, first, last, true);
                           });
            continue;
          }
          // Row blocks of near-equal size (7 rows with MR 6 -> 4 + 3, not 6 + 1).
          int64_t left = r1 - r0;
          for (int64_t r = r0; r < r1;) {
            const int64_t blocks = (left + mr_max - 1) / mr_max;
            const int mr = static_cast<int>((left + blocks - 1) / blocks);
            if (dp)
              dp->fn[mr][np](P.xb + r * ldx + 2 * k0, ldx, wg, pstride, kn, tile);
            else
              table.fn[mr][np](P.x + r * ldx + 2 * k0, ldx, wg, pstride, kn, tile);
            epilogue(P, tile, np * kPanel, r, mr, c0, nc, first, last, vec);
            r += mr;
            left -= mr;
          }
        }
      }
      t += g1 - g0;
    }
#if defined(__x86_64__)
    if (amx) {
      amx_release();
      // ATen's own AMX GEMMs (cpublas::brgemm) cache "my tile configuration is loaded" per
      // thread; forget it so that their next call configures the tiles again.
      at::native::cpublas::brgemm_release();
    }
#endif
  });
}

// dst[i, j] = src[i, j] for j < K (converted), dst[i, K] = 0 when ld > K.
template <typename S, typename D>
void copy_rows(const S* src, int64_t s0, int64_t s1, int64_t M, int64_t K, D* dst, int64_t ld) {
  for (int64_t i = 0; i < M; ++i) {
    const S* a = src + i * s0;
    D* d = dst + i * ld;
    if (std::is_same_v<S, D> && s1 == 1)
      std::memcpy(d, a, K * sizeof(D));
    else if (s1 == 1)
      for (int64_t j = 0; j < K; ++j) d[j] = static_cast<D>(static_cast<float>(a[j]));
    else
      for (int64_t j = 0; j < K; ++j) d[j] = static_cast<D>(static_cast<float>(a[j * s1]));
    for (int64_t j = K; j < ld; ++j) d[j] = D(0.f);
  }
}

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kPanel && packed.size(3) == 2 && packed.size(0) > 0 &&
                  packed.size(1) > 0,
              "packed must be a bf16 tensor [Np/16, Kp/2, 16, 2] from kvmesh::pack_bf16_weight, "
              "got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(packed.is_contiguous() && packed.device().is_cpu(),
              "packed must be a contiguous CPU tensor");
}

}  // namespace

// The micro-kernels bf16_linear runs at level `isa` for bfloat16 activations of kAmxMinRows
// rows or more: every level has its own (fp32 activations take avx512 at avx512bf16 and amx,
// bf16 activations of fewer rows avx512bf16 at amx).
const char* gemm_path(Isa isa) { return kvmesh::isa_name(isa); }

// w [N, K] (any floating dtype, CPU) -> bf16 [ceil(N/16), 16 ceil(K/32), 16, 2] (layout: micro.h),
// rounded to nearest even; padding is zero.
at::Tensor pack_bf16_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && at::isFloatingType(w.scalar_type()) && w.device().is_cpu(),
              "pack_bf16_weight: w must be a 2-D floating CPU tensor [N, K], got ",
              w.scalar_type(), " ", w.sizes(), " on ", w.device());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K > 0, "pack_bf16_weight: empty weight ", w.sizes());
  const int64_t Np = (N + kPanel - 1) / kPanel * kPanel, Kp = (K + 31) / 32 * 32;
  at::Tensor wb = at::constant_pad_nd(w.to(at::kBFloat16), {0, Kp - K, 0, Np - N}, 0);
  return wb.view({Np / kPanel, kPanel, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] fp32 or bf16, packed from pack_bf16_weight(W [N, K]), bias [N] or None
// -> [M, N] in x's dtype = x @ W^T + bias, fp32 accumulation.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_linear: x must be a 2-D float32 or bfloat16 CPU tensor [M, K], got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
  check_packed(packed);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), kp = packed.size(1);
  TORCH_CHECK(kp % 16 == 0 && K <= 2 * kp && K > 2 * kp - 32, "bf16_linear: x has K=", K,
              " but packed was made for K in [", 2 * kp - 31, ", ", 2 * kp, "]");
  TORCH_CHECK(N > (NB - 1) * kPanel && N <= NB * kPanel, "bf16_linear: N=", N,
              " does not match packed (", NB, " panels of 16)");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu(),
                "bf16_linear: bias must be a CPU tensor [", N, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;

  const Isa isa = kvmesh::active_isa();
  const bool bf16_in = x.scalar_type() == at::kBFloat16;
  const bool use_dp = isa >= Isa::kAvx512Bf16 && bf16_in;
  const bool use_amx = isa == Isa::kAmx && bf16_in && M >= kAmxMinRows;
  const int64_t Mx = use_amx ? (M + 15) / 16 * 16 : M;      // rows of xk
  // The micro-kernels read whole, contiguous k-pairs: copy (and convert) x unless it already
  // is fp32 [M, 2 kp] contiguous; K up to Kp gets zero columns (and AMX zero rows up to a
  // multiple of 16). A plain loop: this runs for every decode-step projection, where each
  // extra ATen op costs microseconds.
  at::Tensor xk = x, tail;
  const int64_t M16 = M / 16 * 16;
  if (use_amx && Mx > M && x.is_contiguous() && K == 2 * kp) {
    // AMX on x as it is: only the rows past the last whole 16-row tile are copied, zero-padded
    tail = at::zeros({16, 2 * kp}, x.options());
    std::memcpy(tail.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>() + M16 * K, (M - M16) * K * sizeof(c10::BFloat16));
  } else if (use_dp ? !(x.is_contiguous() && K == 2 * kp && Mx == M)
                    : !(x.scalar_type() == at::kFloat && x.is_contiguous() && K == 2 * kp)) {
    xk = at::empty({Mx, 2 * kp}, x.options().dtype(use_dp ? at::kBFloat16 : at::kFloat));
    if (Mx > M) xk.narrow(0, M, Mx - M).zero_();
    if (use_dp)
      copy_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1), M, K,
                xk.data_ptr<c10::BFloat16>(), 2 * kp);
    else if (bf16_in)
      copy_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1), M, K,
                xk.data_ptr<float>(), 2 * kp);
    else
      copy_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), M, K, xk.data_ptr<float>(), 2 * kp);
  }
  // AMX: row chunks whose bf16 x (MC x K) stays in L2 (kAmxXBytes), at least 64 rows, whole K:
  // each panel group's weights serve all of a chunk's row blocks (docs/engine.md, kernel constants)
  const int64_t mc_max = use_amx ? std::max<int64_t>(64, kAmxXBytes / (4 * kp) / 32 * 32) : kMC;
  const int64_t m_chunks = (M + mc_max - 1) / mc_max;
  int64_t MC = (M + m_chunks - 1) / m_chunks;           // equal chunks: 64 -> 32 + 32
  if (use_amx) MC = (MC + 15) / 16 * 16;                // AMX row blocks start at multiples of 16
  const int64_t KCP = use_amx || MC * 2 * kp * (use_dp ? 2 : 4) <= kXSlice ? kp : std::min(kp, kKCP);
  at::Tensor acc;
  if (bf16_in && KCP < kp) acc = at::empty({M, N}, x.options().dtype(at::kFloat));

  Problem P{M, N, NB, kp,
            use_dp ? nullptr : xk.data_ptr<float>(),
            use_dp ? reinterpret_cast<const uint16_t*>(xk.data_ptr<at::BFloat16>()) : nullptr,
            tail.defined() ? reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()) : nullptr, M16,
            reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
            b.defined() ? b.data_ptr<float>() : nullptr,
            bf16_in ? nullptr : out.data_ptr<float>(),
            bf16_in ? out.data_ptr<c10::BFloat16>() : nullptr,
            acc.defined() ? acc.data_ptr<float>() : nullptr, use_amx};
  run(P, isa, MC, KCP);
  return out;
}

}  // namespace kvmesh_gemm

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("pack_bf16_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int N, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("pack_bf16_weight", &kvmesh_gemm::pack_bf16_weight);
  m.impl("bf16_linear", &kvmesh_gemm::bf16_linear);
}
