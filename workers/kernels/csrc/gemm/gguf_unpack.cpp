// kvmesh::gguf_unpack: one GGUF tensor's blocks (llama.cpp's Q4_0 ... Q6_K, ggml-common.h) decoded
// to the integer form the gguf_linear kernel packs (workers/quant/gguf_blocks.py, its docstring):
//   w[n][k] = s[n][g] q[n][k] + z[n][g], g = k / G,
// flat formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; G = 32): a = s, b = z, float32 [N, K/32] (float16
// values); k-quants (Q4_K, Q5_K: G = 32; Q6_K: G = 16): a = sc, b = m int8 [N, K/G], d, dmin float32
// [N, K/256], s = d sc, z = -dmin m (Q6_K: d sc (q - 32), so m = sc and dmin = 32 d).
// The same numbers as gguf_blocks.unpack_torch (the PyTorch reference the tests compare against),
// in one pass over the file's bytes per row: the load-time decode, which in PyTorch ops took most
// of a start-up (a dozen passes over [N, K] temporaries per tensor).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>

namespace kvmesh_gemm {
namespace {

enum class Type { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };

struct Format {
  Type type;
  int values, bytes, group;     // values and bytes per block; G
  bool kquant;
};

Format format_of(const std::string& t) {
  if (t == "Q4_0") return {Type::Q4_0, 32, 18, 32, false};
  if (t == "Q4_1") return {Type::Q4_1, 32, 20, 32, false};
  if (t == "Q5_0") return {Type::Q5_0, 32, 22, 32, false};
  if (t == "Q5_1") return {Type::Q5_1, 32, 24, 32, false};
  if (t == "Q8_0") return {Type::Q8_0, 32, 34, 32, false};
  if (t == "Q4_K") return {Type::Q4_K, 256, 144, 32, true};
  if (t == "Q5_K") return {Type::Q5_K, 256, 176, 32, true};
  if (t == "Q6_K") return {Type::Q6_K, 256, 210, 16, true};
  TORCH_CHECK(false, "gguf_unpack: GGUF type ", t, " is not supported (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  return {};
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Q4_K / Q5_K: the 12 scale bytes -> 6-bit (sc, m) of the 8 groups (ggml-quants.c get_scale_min_k4)
inline void k_scales(const uint8_t* s, int8_t* sc, int8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = (int8_t)(s[j] & 0x3F);
    m[j] = (int8_t)(s[j + 4] & 0x3F);
    sc[j + 4] = (int8_t)((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    m[j + 4] = (int8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

// one block of a flat format: q[0..32), (s, z) of its group
void flat_block(Type t, const uint8_t* b, uint8_t* q, float* s, float* z) {
  const float d = f16(b);
  *s = d;
  if (t == Type::Q8_0) {
    for (int i = 0; i < 32; ++i) q[i] = (uint8_t)((int)(int8_t)b[2 + i] + 128);
    *z = -128.f * d;
    return;
  }
  const bool with_min = t == Type::Q4_1 || t == Type::Q5_1;
  *z = with_min ? f16(b + 2) : (t == Type::Q4_0 ? -8.f * d : -16.f * d);
  const int off = with_min ? 4 : 2;
  if (t == Type::Q4_0 || t == Type::Q4_1) {
    const uint8_t* qs = b + off;
    for (int i = 0; i < 16; ++i) {
      q[i] = qs[i] & 0x0F;
      q[16 + i] = qs[i] >> 4;
    }
    return;
  }
  uint32_t qh;                 // Q5_0 / Q5_1: bit j of the little-endian word is value j's fifth bit
  std::memcpy(&qh, b + off, 4);
  const uint8_t* qs = b + off + 4;
  for (int i = 0; i < 16; ++i) {
    q[i] = (uint8_t)((qs[i] & 0x0F) | (((qh >> i) & 1u) << 4));
    q[16 + i] = (uint8_t)((qs[i] >> 4) | (((qh >> (16 + i)) & 1u) << 4));
  }
}

// one super-block of a k-quant: q[0..256), sc/m of its groups, d, dmin
void k_block(Type t, const uint8_t* b, uint8_t* q, int8_t* sc, int8_t* m, float* d, float* dmin) {
  if (t == Type::Q6_K) {           // ql [0:128], qh [128:192], scales int8 [192:208], d [208:210]
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 32; ++i) {
        const uint8_t l0 = ql[64 * h + i], l1 = ql[64 * h + 32 + i], hb = qh[32 * h + i];
        uint8_t* o = q + 128 * h;
        o[i] = (uint8_t)((l0 & 0x0F) | ((hb & 3) << 4));
        o[32 + i] = (uint8_t)((l1 & 0x0F) | (((hb >> 2) & 3) << 4));
        o[64 + i] = (uint8_t)((l0 >> 4) | (((hb >> 4) & 3) << 4));
        o[96 + i] = (uint8_t)((l1 >> 4) | (((hb >> 6) & 3) << 4));
      }
    std::memcpy(sc, b + 192, 16);
    std::memcpy(m, b + 192, 16);
    *d = f16(b + 208);
    *dmin = 32.f * *d;
    return;
  }
  *d = f16(b);                 // Q4_K / Q5_K: d, dmin [0:4], scales [4:16], (Q5_K: qh [16:48]), qs [-128:]
  *dmin = f16(b + 2);
  k_scales(b + 4, sc, m);
  const uint8_t* qs = b + (t == Type::Q5_K ? 48 : 16);
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 32; ++i) {
      q[64 * c + i] = qs[32 * c + i] & 0x0F;
      q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
    }
  if (t == Type::Q5_K) {           // bit j of qh[i] is value 32 j + i's fifth bit
    const uint8_t* qh = b + 16;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) q[32 * j + i] |= (uint8_t)(((qh[i] >> j) & 1) << 4);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> gguf_unpack(
    const at::Tensor& raw, const std::string& ggml_type, int64_t k) {
  const Format f = format_of(ggml_type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte, "gguf_unpack: raw must be uint8 [N, row bytes], got ",
              raw.scalar_type(), " ", raw.sizes());
  TORCH_CHECK(k > 0 && k % f.values == 0 && raw.size(1) == k / f.values * f.bytes, ggml_type, ": a row of ", k,
              " values needs ", k / f.values * f.bytes, " bytes, got ", raw.size(1));
  const int64_t N = raw.size(0), nb = k / f.values, G = f.group;
  const at::Tensor src = raw.contiguous();
  const uint8_t* in = src.data_ptr<uint8_t>();
  at::Tensor q = at::empty({N, k}, raw.options());
  uint8_t* qo = q.data_ptr<uint8_t>();
  if (!f.kquant) {
    at::Tensor s = at::empty({N, nb}, raw.options().dtype(at::kFloat)), z = at::empty_like(s);
    float *so = s.data_ptr<float>(), *zo = z.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t i = 0; i < nb; ++i)
          flat_block(f.type, in + (n * nb + i) * f.bytes, qo + n * k + i * 32, so + n * nb + i, zo + n * nb + i);
    });
    return {q, s, z, std::nullopt, std::nullopt};
  }
  const int64_t per = 256 / G;
  at::Tensor sc = at::empty({N, k / G}, raw.options().dtype(at::kChar)), m = at::empty_like(sc);
  at::Tensor d = at::empty({N, nb}, raw.options().dtype(at::kFloat)), dmin = at::empty_like(d);
  int8_t *sco = sc.data_ptr<int8_t>(), *mo = m.data_ptr<int8_t>();
  float *dout = d.data_ptr<float>(), *dmo = dmin.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t i = 0; i < nb; ++i)
        k_block(f.type, in + (n * nb + i) * f.bytes, qo + n * k + i * 256, sco + n * (k / G) + i * per,
                mo + n * (k / G) + i * per, dout + n * nb + i, dmo + n * nb + i);
  });
  return {q, sc, m, d, dmin};
}

}  // namespace
}  // namespace kvmesh_gemm

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("gguf_unpack(Tensor raw, str ggml_type, int k) -> (Tensor q, Tensor a, Tensor b, Tensor? d, Tensor? dmin)");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("gguf_unpack", &kvmesh_gemm::gguf_unpack); }
