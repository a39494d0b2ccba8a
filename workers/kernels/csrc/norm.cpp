// kvmesh::rms_norm / kvmesh::add_rms_norm: RMSNorm (Zhang & Sennrich 2019) and the pre-norm
// block's residual add fused into it (vLLM's fused_add_rms_norm), one pass per row instead of
// ~8 ATen ops (to float, pow, mean, add, rsqrt, mul, mul, cast) per call: a decode step of a
// 30-layer model makes 61 such calls, each op costing microseconds of dispatch at batch 1.
//
// Numerics follow workers.models.llama.RMSNorm: the residual sum is rounded to x's dtype
// first (sum = dtype(x + residual)), then y = dtype(float(sum) / sqrt(mean(float(sum)^2) + eps)
// * float(weight)). The mean is accumulated in float32 in a different order from ATen's, so
// results may differ from the reference in the last bit of float32 (the engine uses these ops
// for bfloat16 and float16 models only; float32 keeps the PyTorch reference).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "bf16.h"
#include "isa.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace kvmesh {
namespace {

void check(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "kvmesh::", op,
              ": x must be a contiguous 2-D CPU tensor [T, hidden], got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kvmesh::", op, ": x must be floating, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.device().is_cpu(), "kvmesh::", op,
              ": weight must be a contiguous CPU tensor [", x.size(1), "], got ", w.sizes());
}

// out = norm(src) for rows [0, T); sum (if not null) = dtype(x + residual) is written first
template <typename T>
void run(const T* x, const T* res, T* sum, const float* w, T* out, int64_t rows, int64_t H, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      const T* src = xr;
      if (res != nullptr) {
        const T* rr = res + r * H;
        T* sr = sum + r * H;
        for (int64_t i = 0; i < H; ++i) sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        src = sr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const float v = static_cast<float>(src[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      T* o = out + r * H;
      for (int64_t i = 0; i < H; ++i) o[i] = static_cast<T>(static_cast<float>(src[i]) * inv * w[i]);
    }
  });
}

// The bfloat16 row of run<> in plain integer / float loops that GCC vectorises, written once and
// compiled twice: for AVX-512F (row_bf16_avx512) and for baseline x86-64 (row_bf16_scalar); the
// c10::BFloat16 loops above stayed scalar and cost 33 ms of a 1.5k-token SmolLM2 prefill.
__attribute__((always_inline)) inline void row_bf16_body(const uint16_t* __restrict x, const uint16_t* __restrict res,
                                                         uint16_t* __restrict sum, const float* __restrict w,
                                                         uint16_t* __restrict o, int64_t H, float eps) {
  const uint16_t* src = x;
  if (res != nullptr) {
    for (int64_t i = 0; i < H; ++i) sum[i] = f32_bf16(bf16_f32(x[i]) + bf16_f32(res[i]));
    src = sum;
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += bf16_f32(src[i]) * bf16_f32(src[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) o[i] = f32_bf16(bf16_f32(src[i]) * inv * w[i]);
}

using RowFn = void (*)(const uint16_t*, const uint16_t*, uint16_t*, const float*, uint16_t*, int64_t, float);

void row_bf16_scalar(const uint16_t* __restrict x, const uint16_t* __restrict res, uint16_t* __restrict sum,
                     const float* __restrict w, uint16_t* __restrict o, int64_t H, float eps) {
  row_bf16_body(x, res, sum, w, o, H, eps);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void row_bf16_avx512(const uint16_t* __restrict x, const uint16_t* __restrict res,
                                                        uint16_t* __restrict sum, const float* __restrict w,
                                                        uint16_t* __restrict o, int64_t H, float eps) {
  row_bf16_body(x, res, sum, w, o, H, eps);
}
#endif

RowFn row_bf16_at(Isa isa) {
#if defined(__x86_64__)
  if (isa >= Isa::kAvx512) return row_bf16_avx512;
#endif
  (void)isa;
  return row_bf16_scalar;
}

void dispatch(const at::Tensor& x, const at::Tensor* res, at::Tensor* sum, const at::Tensor& w, at::Tensor& out,
              double eps) {
  const at::Tensor wf = w.to(at::kFloat).contiguous();
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const auto* rp = res ? reinterpret_cast<const uint16_t*>(res->data_ptr<at::BFloat16>()) : nullptr;
    auto* sp = sum ? reinterpret_cast<uint16_t*>(sum->data_ptr<at::BFloat16>()) : nullptr;
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const float* wp = wf.data_ptr<float>();
    const int64_t H = x.size(1);
    const RowFn row_bf16 = row_bf16_at(active_isa());
    at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        row_bf16(xp + r * H, rp ? rp + r * H : nullptr, sp ? sp + r * H : nullptr, wp, op + r * H, H,
                 static_cast<float>(eps));
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kvmesh_rms_norm", [&] {
    run<scalar_t>(x.data_ptr<scalar_t>(), res ? res->data_ptr<scalar_t>() : nullptr,
                  sum ? sum->data_ptr<scalar_t>() : nullptr, wf.data_ptr<float>(), out.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), eps);
  });
}

}  // namespace

// The bfloat16 row loop rms_norm / add_rms_norm run at level `isa`: "avx512" (AVX-512F) at avx512
// and above, else "scalar" (no avx2 build: avx2 runs scalar). float32 / float16: one loop for all.
const char* norm_path(Isa isa) { return row_bf16_at(isa) == row_bf16_scalar ? "scalar" : "avx512"; }

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  dispatch(x, nullptr, nullptr, weight, out, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "kvmesh::add_rms_norm: residual must be contiguous with x's shape and dtype, got ", residual.sizes(),
              " ", residual.scalar_type());
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  dispatch(x, &residual, &sum, weight, out, eps);
  return {out, sum};
}

}  // namespace kvmesh
