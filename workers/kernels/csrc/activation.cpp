// kvmesh::silu_and_mul_bf16: the gated MLP's activation, silu(gate) * up, of a stacked bfloat16
// [T, 2 I] gate/up projection in one pass (vLLM's silu_and_mul), instead of ATen's chunk, silu
// and mul (two passes over [T, I] with an intermediate tensor) (figures: docs/engine.md, "Kernel constants and the measurements behind them").
//
// Numerics follow workers.models.llama.silu_and_mul in bfloat16: s = bf16(g / (1 + exp(-g)))
// computed in float32, then out = bf16(float(s) * float(up)), both rounded to nearest even.
// exp is a polynomial (the attention kernel's: relative error ~1e-7) rather than ATen's, so an
// output may differ from the reference by one bfloat16 ulp where the float32 value sits at a
// rounding boundary. The AVX-512 loop (act_avx512.cpp) runs at the avx512 level and above
// (isa.h, silu_path); below it, and for a row's last I mod 16 elements, a scalar loop.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"
#include "isa.h"

namespace kvmesh {
#if defined(__x86_64__)
int64_t silu_mul_avx512(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n);   // act_avx512.cpp
#endif
namespace {

void silu_mul_scalar(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = bf16_f32(g[i]);
    o[i] = f32_bf16(bf16_f32(f32_bf16(x / (1.f + std::exp(-x)))) * bf16_f32(u[i]));
  }
}

// The level of the loop run at level `isa`: avx512 at avx512 and above (x86-64), else scalar.
Isa silu_level(Isa isa) {
#if defined(__x86_64__)
  return isa >= Isa::kAvx512 ? Isa::kAvx512 : Isa::kScalar;
#else
  (void)isa;
  return Isa::kScalar;
#endif
}

}  // namespace

// The loop silu_and_mul_bf16 runs at level `isa`: "avx512" at avx512 and above, else "scalar"
// (no avx2 build: avx2 runs scalar).
const char* silu_path(Isa isa) { return isa_name(silu_level(isa)); }

// x: contiguous bfloat16 [T, 2 I] (gate columns, then up columns). Returns [T, I].
at::Tensor silu_and_mul_bf16_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  x.size(1) % 2 == 0,
              "kvmesh::silu_and_mul_bf16: x must be a contiguous bfloat16 CPU tensor [T, 2 I], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const bool avx512 = silu_level(active_isa()) == Isa::kAvx512;
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#if defined(__x86_64__)
      if (avx512) {
        const int64_t done = silu_mul_avx512(xp + t * 2 * I, xp + t * 2 * I + I, op + t * I, I);
        silu_mul_scalar(xp + t * 2 * I + done, xp + t * 2 * I + I + done, op + t * I + done, I - done);
        continue;
      }
#endif
      silu_mul_scalar(xp + t * 2 * I, xp + t * 2 * I + I, op + t * I, I);
    }
  });
  return out;
}

}  // namespace kvmesh
