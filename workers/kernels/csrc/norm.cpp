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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "bf16_bits.h"

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

#if defined(__x86_64__)
#define KV_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define KV_CLONES
#endif

// The bfloat16 row of run<> in plain integer / float loops that GCC vectorises (compiled for
// AVX-512F and baseline x86-64, picked at load time): the c10::BFloat16 loops above stayed
// scalar and cost 33 ms of a 1.5k-token SmolLM2 prefill.
KV_CLONES void row_bf16(const uint16_t* __restrict x, const uint16_t* __restrict res, uint16_t* __restrict sum,
                        const float* __restrict w, uint16_t* __restrict o, int64_t H, float eps) {
  const uint16_t* src = x;
  if (res != nullptr) {
    for (int64_t i = 0; i < H; ++i) sum[i] = f2b(b2f(x[i]) + b2f(res[i]));
    src = sum;
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += b2f(src[i]) * b2f(src[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) o[i] = f2b(b2f(src[i]) * inv * w[i]);
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
