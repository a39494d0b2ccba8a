#pragma GCC target("avx2,fma,f16c")
// The avx2 instantiation of the KV requantization loops (see requant.h).
#define KVMESH_ISA 1
#define KVMESH_NS rq_avx2
#include "requant.h"

namespace kvmesh {
// Requantizes one (K or V, block, head) slice in place: dequantize with s_old unless
// `restart` (then zeros), overwrite the rows `offs[i]` with `rows[i]` ([D] float32 each),
// quantize with the new scale (returned). Q8: 0 int8, 1 e4m3fn.
float requantize_avx2(int q8, uint8_t* blk, int64_t st, int64_t BS, int64_t D, float s_old, bool restart,
                     const float* const* rows, const int32_t* offs, int64_t n, float* buf) {
  if (restart) std::memset(buf, 0, sizeof(float) * BS * D);
  else if (q8 == 0) rq_avx2::dequantize<0>(blk, st, BS, D, s_old, buf);
  else rq_avx2::dequantize<1>(blk, st, BS, D, s_old, buf);
  for (int64_t i = 0; i < n; ++i) std::memcpy(buf + offs[i] * D, rows[i], sizeof(float) * D);
  return q8 == 0 ? rq_avx2::quantize<0>(buf, BS, D, blk, st) : rq_avx2::quantize<1>(buf, BS, D, blk, st);
}
}  // namespace kvmesh
