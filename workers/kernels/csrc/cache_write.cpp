// kvmesh::reshape_and_cache: store new K/V rows at their cache slots. Float caches: cast and
// copy. int8 / float8_e4m3fn caches: exactly the read-modify-write of
// workers/kv_cache.py:KVCache.write, per touched block and for all KV heads of K and V:
// dequantize (stored * scale, float32), zero the block if this write touches its slot 0
// (it starts over), place the new tokens (float32), amax over the block's slots and D,
//   int8: scale = max(amax / 127, 2^-60), q = clamp(round_half_even(x / scale), +-127)
//   fp8:  scale = exp2(ceil(log2(max(amax / 448, 2^-60)))), q = e4m3(clamp(x / scale, +-448))
// (same float32 operations in the same order, so the stored bytes and scales are identical;
// the per-element loops are in requant.h: scalar and avx2; levels above avx2 run the avx2 loops,
// kv_write_path).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"

namespace kvmesh {

float requantize_scalar(int q8, uint8_t* blk, int64_t st, int64_t BS, int64_t D, float s_old, bool restart,
                        const float* const* rows, const int32_t* offs, int64_t n, float* buf);
float requantize_avx2(int q8, uint8_t* blk, int64_t st, int64_t BS, int64_t D, float s_old, bool restart,
                      const float* const* rows, const int32_t* offs, int64_t n, float* buf);

namespace {

// The level of the requantization loops run at level `isa`: avx2 at avx2 and above (no wider code)
Isa kv_write_level(Isa isa) { return std::min(isa, Isa::kAvx2); }

// One touched block: K and V, every KV head (see the file comment)
void requantize_block(int q8, uint8_t* data, float* scales, const float* k, const float* v, const int64_t* toks,
                      const int32_t* offs, int64_t ntok, int64_t b, int64_t NB, int64_t BS, int64_t KVH, int64_t D,
                      float* buf, std::vector<const float*>& rows, bool avx2) {
  const bool restart = std::any_of(offs, offs + ntok, [](int32_t o) { return o == 0; });
  const int64_t half = NB * BS * KVH * D;
  rows.resize(ntok);
  for (int kv = 0; kv < 2; ++kv) {
    uint8_t* blk = data + kv * half + b * BS * KVH * D;
    float* sc = scales + kv * NB * KVH + b * KVH;
    const float* src = kv == 0 ? k : v;
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t i = 0; i < ntok; ++i) rows[i] = src + (toks[i] * KVH + h) * D;
      sc[h] = (avx2 ? requantize_avx2 : requantize_scalar)(q8, blk + h * D, KVH * D, BS, D, sc[h], restart,
                                                            rows.data(), offs, ntok, buf);
    }
  }
}

}  // namespace

// The requantization loops (int8 / fp8 caches) at level `isa`: "avx2" or "scalar".
const char* kv_write_path(Isa isa) { return isa_name(kv_write_level(isa)); }

void reshape_and_cache_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_data,
                           const std::optional<at::Tensor>& scales, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_data.dim() == 5 && kv_data.size(0) == 2 && kv_data.is_contiguous(),
              "kvmesh::reshape_and_cache: kv_data must be a contiguous [2, NB, BS, KVH, D] tensor");
  const int64_t NB = kv_data.size(1), BS = kv_data.size(2), KVH = kv_data.size(3), D = kv_data.size(4);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == KVH && k.size(2) == D && v.sizes() == k.sizes(),
              "kvmesh::reshape_and_cache: k and v must both be [T, ", KVH, ", ", D, "], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(at::isFloatingType(k.scalar_type()) && at::isFloatingType(v.scalar_type()),
              "kvmesh::reshape_and_cache: k and v must be floating point");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
              "kvmesh::reshape_and_cache: slot_mapping must be int64 [T]");
  const auto dt = kv_data.scalar_type();
  const bool quant = dt == at::kChar || dt == at::kFloat8_e4m3fn;
  TORCH_CHECK(quant == (scales.has_value() && scales->defined()),
              "kvmesh::reshape_and_cache: scales are required for (and only for) an int8/float8 cache");
  TORCH_CHECK(quant || dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "kvmesh::reshape_and_cache: unsupported cache dtype ", dt);
  const int64_t T = k.size(0);
  if (T == 0) return;
  at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] < NB * BS, "kvmesh::reshape_and_cache: slot ", sl[t], " of token ", t, " is beyond the cache (", NB * BS, " slots)");

  if (!quant) {
    at::Tensor kc = k.to(dt).contiguous(), vc = v.to(dt).contiguous();
    const int64_t row = KVH * D * kv_data.element_size();
    char* base = static_cast<char*>(kv_data.data_ptr());
    const char* kp = static_cast<const char*>(kc.data_ptr());
    const char* vp = static_cast<const char*>(vc.data_ptr());
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        if (sl[t] < 0) continue;                 // padding slot
        std::memcpy(base + sl[t] * row, kp + t * row, row);
        std::memcpy(base + (NB * BS + sl[t]) * row, vp + t * row, row);
      }
    });
    return;
  }
  TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 3 &&
                  scales->size(0) == 2 && scales->size(1) == NB && scales->size(2) == KVH,
              "kvmesh::reshape_and_cache: scales must be contiguous float32 [2, NB, KVH]");
  at::Tensor kf = k.to(at::kFloat).contiguous(), vf = v.to(at::kFloat).contiguous();
  // tokens grouped by block (stable: a slot written twice keeps the later token)
  std::vector<int64_t> order;
  for (int64_t t = 0; t < T; ++t)
    if (sl[t] >= 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sl[a] / BS < sl[b] / BS; });
  std::vector<int32_t> offs(order.size());
  for (size_t i = 0; i < order.size(); ++i) offs[i] = int32_t(sl[order[i]] % BS);
  std::vector<int64_t> starts;
  for (size_t i = 0; i < order.size(); ++i)
    if (i == 0 || sl[order[i]] / BS != sl[order[i - 1]] / BS) starts.push_back(int64_t(i));
  starts.push_back(int64_t(order.size()));
  float* sc = scales->data_ptr<float>();
  const float* kp = kf.data_ptr<float>();
  const float* vp = vf.data_ptr<float>();
  const int q8 = dt == at::kChar ? 0 : 1;
  const bool avx2 = kv_write_level(active_isa()) == Isa::kAvx2;
  uint8_t* data = static_cast<uint8_t*>(kv_data.data_ptr());
  at::parallel_for(0, int64_t(starts.size()) - 1, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(BS * D);
    std::vector<const float*> rows;
    for (int64_t u = b; u < e; ++u) {
      const int64_t i0 = starts[u], n = starts[u + 1] - i0, blk = sl[order[i0]] / BS;
      requantize_block(q8, data, sc, kp, vp, order.data() + i0, offs.data() + i0, n, blk, NB, BS, KVH, D,
                       buf.data(), rows, avx2);
    }
  });
}

}  // namespace kvmesh
