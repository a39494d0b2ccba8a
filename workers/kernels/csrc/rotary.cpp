// kvmesh::rotary_bf16: RoPE (Su et al. 2021, the "rotate half" form of GPT-NeoX / Llama) of a
// bfloat16 [T, heads, D] view in one pass, instead of the 7 ATen ops of
// workers.layers.rotary.RotaryEmbedding.rotate (4 multiplies, a subtract, an add, a cat).
//
// Bit-identical to that expression in bfloat16: each multiply, the subtract and the add are
// rounded to bfloat16 (nearest even) as ATen's bfloat16 ops round them, and the compiler may
// not contract a * b - c * d into an FMA (fp-contract=off). The loop is compiled for AVX-512F
// and for baseline x86-64, so that it vectorises; the active level (isa.h) picks one per call.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "bf16.h"
#include "isa.h"

#include <cstdint>
#include <cstring>

namespace kvmesh {
namespace {

#define KV_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

// One row of one head: o[i] = x1 c - x2 s, o[i + h] = x2 c + x1 s (each op rounded), written once
// and compiled twice: for AVX-512F (rotate_row_avx512) and baseline x86-64 (rotate_row_scalar).
KV_NO_CONTRACT __attribute__((always_inline)) inline void rotate_row_body(const uint16_t* __restrict x,
                                                                          const uint16_t* __restrict c,
                                                                          const uint16_t* __restrict s,
                                                                          uint16_t* __restrict o, int64_t h) {
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = bf16_f32(x[i]), x2 = bf16_f32(x[i + h]), ci = bf16_f32(c[i]), si = bf16_f32(s[i]);
    o[i] = f32_bf16(bf16_f32(f32_bf16(x1 * ci)) - bf16_f32(f32_bf16(x2 * si)));
    o[i + h] = f32_bf16(bf16_f32(f32_bf16(x2 * ci)) + bf16_f32(f32_bf16(x1 * si)));
  }
}

using RowFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t);

KV_NO_CONTRACT void rotate_row_scalar(const uint16_t* __restrict x, const uint16_t* __restrict c,
                                      const uint16_t* __restrict s, uint16_t* __restrict o, int64_t h) {
  rotate_row_body(x, c, s, o, h);
}

#if defined(__x86_64__)
KV_NO_CONTRACT __attribute__((target("avx512f"))) void rotate_row_avx512(const uint16_t* __restrict x,
                                                                         const uint16_t* __restrict c,
                                                                         const uint16_t* __restrict s,
                                                                         uint16_t* __restrict o, int64_t h) {
  rotate_row_body(x, c, s, o, h);
}
#endif

RowFn rotate_row_at(Isa isa) {
#if defined(__x86_64__)
  if (isa >= Isa::kAvx512) return rotate_row_avx512;
#endif
  (void)isa;
  return rotate_row_scalar;
}

}  // namespace

// The row loop rotary_bf16 runs at level `isa`: "avx512" (AVX-512F) at avx512 and above, else
// "scalar" (no avx2 build: avx2 runs scalar).
const char* rotary_path(Isa isa) { return rotate_row_at(isa) == rotate_row_scalar ? "scalar" : "avx512"; }

// x: bfloat16 [T, heads, D] with a unit last stride (any row / head strides); cos, sin:
// bfloat16 with T * D / 2 elements, contiguous ([T, 1, D/2] from RotaryEmbedding.cos_sin).
// Returns a new contiguous [T, heads, D].
at::Tensor rotary_bf16_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && x.scalar_type() == at::kBFloat16 &&
                  x.device().is_cpu(),
              "kvmesh::rotary_bf16: x must be a bfloat16 CPU tensor [T, heads, D] with even D and unit last "
              "stride, got ", x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
  const int64_t T = x.size(0), Hs = x.size(1), D = x.size(2), h = D / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == T * h,
                "kvmesh::rotary_bf16: cos and sin must be contiguous bfloat16 with T * D / 2 = ", T * h,
                " elements, got ", t->scalar_type(), " ", t->sizes());
  at::Tensor out = at::empty({T, Hs, D}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t st0 = x.stride(0), st1 = x.stride(1);
  const RowFn rotate_row = rotate_row_at(active_isa());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < Hs; ++j)
        rotate_row(xp + t * st0 + j * st1, cp + t * h, sp + t * h, op + (t * Hs + j) * D, h);
  });
  return out;
}

}  // namespace kvmesh
