// kvmesh::gguf_linear: y = x @ W^T for the GGUF block formats (llama.cpp's Q4_0 ... Q6_K), their
// integers and scales kept as published, repacked at load (workers/quant/gguf_blocks.py,
// workers/kernels/gemm.py pack_gguf_qweight / pack_gguf_scales), with the activations quantized
// per 32 values to int8 and integer dot products -- the scheme of llama.cpp's ggml-cpu
// (quantize_row_q8_0, ggml_vec_dot_q4_K_q8_K), on a layout of our own.
//
// Weights: w[n][k] = s[g][n] * q[n][k] + z[g][n], g = k / G (G = 16 or 32), q unsigned: 4-bit
// lanes (0..15), 6-bit lanes (0..63: Q5, Q6_K) or 8-bit lanes (0..255). 16-column panels; a panel
// is K * bits / 8 * 16 bytes in chunks along k:
//   bits 4: 64-byte chunk c covers k in [8c, 8c + 8): byte 4n + j = q[n][8c + j] & 15 | (q[n][8c + 4 + j] & 15) << 4
//   bits 6: 96-byte chunk c: those 64 bytes of low nibbles, then the high 2 bits of the same
//           weights in 2 x 16 bytes (operand o = 0 for k 8c..8c+3, 1 for 8c+4..8c+7): operand byte
//           i = 16 l + b (i = 4n + j) has its high bits in bits 2l, 2l + 1 of byte 64 + 16 o + b
//   bits 8: 64-byte chunk c covers k in [4c, 4c + 4): byte 4n + j = q[n][4c + j]
// so that (v & 0x0F), (v >> 4) & 0x0F (| the high bits << 4 for bits 6) or v itself (bits 8) is
// the u8 [16 columns x 4 k] operand of vpdpbusd against 4 int8 activations broadcast to every
// 32-bit lane.
// Scales per group and column: flat: float16 (s, z) [P, K/G, 2, 16]; k-quant: int8 (sc, m)
// [P, K/G, 2, 16] with float16 (d, dmin) [P, K/SB, 2, 16] per super-block (the file's own
// numbers): s = d sc, z = -dmin m; a k-quant weight with m = sc and dmin = 32 d (Q6_K's
// d sc (q - 32)) keeps sc and d alone ([P, K/G, 1, 16], [P, K/SB, 1, 16]): the file's bytes.
//
// Activations: per row and block of 32 k, dx = amax / 127, xq = round-half-even(x * 127 / amax)
// (0 for an all-zero block); isum = sum xq q (int32, exact), xsum = sum xq, and
//   y[n] = sum_g dx * (s isum + z xsum).
// Paths (chosen per call from the active level, isa.h; gguf_path): amx
// (bfloat16 x of 32 rows or more -- the compute-bound prefill --: the panels dequantized to
// bfloat16 and AMX-BF16 tiles, no activation quantization; float32 x of 32 rows or more: AMX-INT8
// tiles, bitwise the avx512vnni path's outputs; fewer rows: avx512vnni), avx512vnni (vpdpbusd), avx2 (vpmaddubsw: 4-bit lanes as they are; 8-bit lanes as the signed
// q - 128 with the sign moved onto x, exact, and 128 * xsum added back), scalar. Threads split
// the panels; rows go in blocks of 64 (their int8 x stays in L2 across a thread's panels), 8
// (avx512vnni) or 4 rows at a time per panel (each weight load feeds them all).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "isa.h"
#include "micro.h"

namespace kvmesh_gemm {
namespace {

constexpr int kMR = 4;      // rows per register block (scalar, avx2)
constexpr int kMRVnni = 8;  // rows per register block on avx512vnni (one int32 chain per row from 5 rows)
constexpr int64_t kVnniExpandRows = 16;   // avx512vnni: from these rows per cache block, 6-bit panels expanded to 8-bit lanes
constexpr int64_t kMC = 64;  // rows per cache block
static_assert(kMC % kMRVnni == 0, "avx512vnni's register blocks tile the cache blocks (vnni_block)");
constexpr int64_t kAmxMinRows = 32;   // the amx path's int8 tiles from 32 rows; fewer take avx512vnni
                                      // (faster below 32 rows since its 8-row blocks: docs/engine.md)

// Chunk geometry per lane width: k per chunk and bytes per chunk.
constexpr int chunk_k(int bits) { return bits == 8 ? 4 : 8; }
constexpr int chunk_bytes(int bits) { return bits == 6 ? 96 : 64; }

// q[n][k] from a panel (scalar; the layout of the file comment)
static inline int panel_q(const uint8_t* panel, int bits, int64_t k, int n) {
  if (bits == 8) return panel[(k / 4) * 64 + 4 * n + (k % 4)];
  const int64_t c = k / 8;
  const int j = (int)(k % 8), o = j / 4;
  const uint8_t* ch = panel + c * chunk_bytes(bits);
  const uint8_t b = ch[4 * n + (j & 3)];
  int q = o == 0 ? (b & 0x0F) : (b >> 4);
  if (bits == 6) {
    const int i = 4 * n + (j & 3), l = i / 16;
    q |= ((ch[64 + 16 * o + (i % 16)] >> (2 * l)) & 3) << 4;
  }
  return q;
}

// What one call computes; the per-path kernels read it.
struct GgufProblem {
  const int8_t* xq;       // [M, K]
  const float* dx;        // [M, K / QB]: the activations' scale per block of QB
  int64_t QB;             // 32 (flat scheme) or the super-block (k-quant scheme)
  const int32_t* xs16;    // [M, K / 16] sums of xq over 16 (not on avx512vnni)
  const float* dxs;       // avx512vnni, flat scheme: [M, K / G] dx * xsum per group (float32, the scaling's own product)
  const int32_t* xsp;     // avx512vnni, k-quant: [M, K / G / 2] the sums of xq over groups 2j and 2j + 1 as an int16
                          // pair (|sum| <= 32 x 127), vpdpwssd's operand
  // On avx512vnni xq, dx, dxs and xsp are interleaved per register block (vnni_block): the block of
  // rows [m0, m0 + mr) holds, from row m0's offset, each column (xq: 4-byte quad of k) for its mr
  // rows in turn, so that a register block reads every row's operand at a constant offset from one
  // pointer (vpdpbusd's embedded broadcast, no row pointers).
  int64_t M, K;
  const uint8_t* qw;      // [P, K * bits / 8 * 16]
  const void* scales;     // flat: uint16 (half bits) [P, K/G, 2, 16]; k: int8 [P, K/G, S, 16]
  const uint16_t* supers; // k: float16 (d, dmin) [P, K/SB, S, 16]; flat: nullptr
  int64_t S;              // k: 2, or 1 for a weight whose m = sc and dmin = 32 d (Q6_K): its scales
                          // hold sc alone [P, K/G, 1, 16] and its superscales d alone
  int64_t P;
  int bits, G, SB;
  void* y;                // [M, 16 P] float32, or bfloat16 when y_bf16
  bool y_bf16;
  const float* bias;      // [16 P] added to every row, or nullptr
};

// bfloat16 bits of a float32, round to nearest even (as c10::BFloat16 for non-NaN values)
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void store_row_scalar(const GgufProblem& pb, int64_t m, int64_t p, const float* v) {
  float b[16];
  for (int n = 0; n < 16; ++n) b[n] = v[n] + (pb.bias != nullptr ? pb.bias[p * 16 + n] : 0.f);
  if (pb.y_bf16) {
    uint16_t* y = (uint16_t*)pb.y + m * pb.P * 16 + p * 16;
    for (int n = 0; n < 16; ++n) y[n] = bf16_bits(b[n]);
  } else {
    std::memcpy((float*)pb.y + m * pb.P * 16 + p * 16, b, 16 * sizeof(float));
  }
}

// What the vector paths read per panel call, set up once (no division in their loops): the
// rows' int8 x as 32-bit quads, their activation scales and 16-sums ...
template <int MR>
struct RowPointers {
  const int32_t* xq4[MR];
  const float* dx[MR];
  const int32_t* xs16[MR];
  RowPointers(const GgufProblem& pb, int64_t m0) {
    for (int r = 0; r < MR; ++r) {
      xq4[r] = (const int32_t*)(pb.xq + (m0 + r) * pb.K);
      dx[r] = pb.dx + (m0 + r) * (pb.K / pb.QB);
      xs16[r] = pb.xs16 + (m0 + r) * (pb.K / 16);
    }
  }
};

// ... the sum of a row's xq over group g (G = 16 or 32) ...
template <int G>
static inline int32_t group_xsum(const int32_t* xs16, int64_t g) {
  if constexpr (G == 32) return xs16[2 * g] + xs16[2 * g + 1];
  return xs16[g];
}

// ... and a k-quant panel's scale streams: sc (and m) per group, 16 S bytes; d (and dmin) per
// super-block, 16 S halves; m is sc itself when S = 1.
struct KScales {
  int64_t st, mo;         // bytes per group (halves per super-block); offset of m from sc
  const int8_t* sm;
  const uint16_t* dd;
  KScales(const GgufProblem& pb, int64_t p)
      : st(16 * pb.S), mo(pb.S == 2 ? 16 : 0), sm((const int8_t*)pb.scales + p * (pb.K / pb.G) * st),
        dd(pb.supers + p * (pb.K / pb.SB) * st) {}
};

// The group's (s, z) for the 16 columns of panel p: written to s[16], z[16].
static inline void group_sz(const GgufProblem& pb, int64_t p, int64_t g, float* s, float* z) {
  const int64_t ng = pb.K / pb.G;
  if (pb.supers == nullptr) {
    const uint16_t* h = (const uint16_t*)pb.scales + (p * ng + g) * 32;
    for (int n = 0; n < 16; ++n) {
      s[n] = c10::detail::fp16_ieee_to_fp32_value(h[n]);
      z[n] = c10::detail::fp16_ieee_to_fp32_value(h[16 + n]);
    }
  } else {
    const int8_t* sm = (const int8_t*)pb.scales + (p * ng + g) * 16 * pb.S;
    const int64_t sb = g * pb.G / pb.SB;
    const uint16_t* dd = pb.supers + (p * (pb.K / pb.SB) + sb) * 16 * pb.S;
    const int mo = pb.S == 2 ? 16 : 0;      // where m is: its own plane, or sc itself
    for (int n = 0; n < 16; ++n) {
      const float d = c10::detail::fp16_ieee_to_fp32_value(dd[n]);
      const float dmin = pb.S == 2 ? c10::detail::fp16_ieee_to_fp32_value(dd[16 + n]) : 32.f * d;
      s[n] = d * (float)sm[n];
      z[n] = -(dmin * (float)sm[mo + n]);
    }
  }
}

// ---- scalar ---------------------------------------------------------------------------------

static void panel_rows_scalar(const GgufProblem& pb, int64_t p, int64_t m0, int mr) {
  const int64_t K = pb.K, ng = K / pb.G, pbytes = K * pb.bits * 2;
  const uint8_t* panel = pb.qw + p * pbytes;
  float out[kMR][16] = {};
  float s[16], z[16];
  for (int64_t g = 0; g < ng; ++g) {
    group_sz(pb, p, g, s, z);
    for (int r = 0; r < mr; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xq = pb.xq + m * K;
      const float dx = pb.dx[m * (K / pb.QB) + g * pb.G / pb.QB];
      int32_t xsum = 0;
      for (int h = 0; h < pb.G / 16; ++h) xsum += pb.xs16[m * (K / 16) + g * pb.G / 16 + h];
      for (int n = 0; n < 16; ++n) {
        int32_t acc = 0;
        for (int64_t k = g * pb.G; k < (g + 1) * pb.G; ++k) acc += (int32_t)xq[k] * panel_q(panel, pb.bits, k, n);
        out[r][n] += dx * (s[n] * (float)acc + z[n] * (float)xsum);
      }
    }
  }
  for (int r = 0; r < mr; ++r) store_row_scalar(pb, m0 + r, p, out[r]);
}

static void quantize_rows_scalar(const float* x, int64_t K, int64_t QB, int8_t* xq, float* dx, int32_t* xs16) {
  for (int64_t b = 0; b < K / QB; ++b) {
    float amax = 0.f;
    for (int64_t i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(x[b * QB + i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    dx[b] = amax / 127.f;
    for (int64_t h = 0; h < QB / 16; ++h) {
      int32_t sum = 0;
      for (int64_t i = b * QB + 16 * h; i < b * QB + 16 * h + 16; ++i) {
        const float v = std::nearbyint(x[i] * inv);
        const int q = (int)std::max(-127.f, std::min(127.f, v));
        xq[i] = (int8_t)q;
        sum += q;
      }
      xs16[b * (QB / 16) + h] = sum;
    }
  }
}

#if defined(__x86_64__)
// The weights are read kPrefetch bytes ahead of the group being multiplied (prefetcht0, one per
// 64-byte line of the group): the decode GEMV streams every panel once from memory, and the
// hardware prefetchers do not cross 4 KiB pages (figures: docs/engine.md, "Kernel constants and the measurements behind them";
// the decode GEMV's gain there).
constexpr int kPrefetch = 4096;
template <int BYTES>
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* p) {
#pragma GCC unroll 8
  for (int o = 0; o < BYTES; o += 64) _mm_prefetch((const char*)(p + kPrefetch + o), _MM_HINT_T0);
}

// ---- AVX-512 VNNI ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")

// y[m][16 p .. 16 p + 15] = v (+ the bias), as float32 or bfloat16 (round to nearest even in
// integers: no AVX512-BF16 needed)
static inline __attribute__((always_inline)) void store_row_avx512(const GgufProblem& pb, int64_t m, int64_t p, __m512 v) {
  if (pb.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(pb.bias + p * 16));
  const int64_t off = m * pb.P * 16 + p * 16;
  if (pb.y_bf16) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256((__m256i*)((uint16_t*)pb.y + off), _mm512_cvtepi32_epi16(b));
  } else {
    _mm512_storeu_ps((float*)pb.y + off, v);
  }
}

// A 4- or 6-bit chunk at pc as its two u8 [16 columns x 4 k] operands: w0 for k 8c..8c+3, w1
// for 8c+4..8c+7 (the nibble plane, plus the high 2 bits of the 6-bit lanes: the layout of the
// file comment).
template <int BITS>
static inline __attribute__((always_inline)) void chunk_operands(const uint8_t* pc, __m512i& w0, __m512i& w1) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(pc);
  w0 = _mm512_and_si512(v, lo4);
  w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
  if constexpr (BITS == 6) {
    // per 128-bit lane l, the shift that brings bits 2l, 2l+1 of a high-plane byte down
    const __m512i hshift = _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0), lo2 = _mm512_set1_epi8(0x03);
    const __m512i h0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(pc + 64)));
    const __m512i h1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(pc + 80)));
    w0 = _mm512_or_si512(w0, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(h0, hshift), lo2), 4));
    w1 = _mm512_or_si512(w1, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(h1, hshift), lo2), 4));
  }
}

// acc[r][0] (+ acc[r][1]) = the integer dot products q . xq of one group (G values of k) for rows
// r < MR and the panel's 16 columns (int32); xi: the group's int8 x quads, interleaved [G / 4][MR]. NC chains per row: 2 for blocks of up to 4 rows (for
// vpdpbusd's latency), 1 from 5 rows (as many independent chains as rows). q is unsigned (u8
// operand), xq signed: exact for every lane width.
template <int MR, int NC, int BITS, int G>
static inline __attribute__((always_inline)) void group_dots_vnni(const uint8_t* pg, const int32_t* xi,
                                                                  __m512i (&acc)[MR][NC]) {
  constexpr int kChunks = G / chunk_k(BITS), kCB = chunk_bytes(BITS);    // chunks per group, bytes each
  prefetch_ahead<kChunks * kCB>(pg);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int c = 0; c < kChunks; ++c) {
    if constexpr (BITS == 4 || BITS == 6) {
      __m512i w0, w1;
      chunk_operands<BITS>(pg + c * kCB, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, _mm512_set1_epi32(xi[2 * c * MR + r]));
        acc[r][NC - 1] = _mm512_dpbusd_epi32(acc[r][NC - 1], w1, _mm512_set1_epi32(xi[(2 * c + 1) * MR + r]));
      }
    } else {
      const __m512i v = _mm512_loadu_si512(pg + c * kCB);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        acc[r][c % NC] = _mm512_dpbusd_epi32(acc[r][c % NC], v, _mm512_set1_epi32(xi[c * MR + r]));
    }
  }
}

// A group's isum of row r: its chains added (exact)
template <int MR, int NC>
static inline __attribute__((always_inline)) __m512i group_isum(const __m512i (&acc)[MR][NC], int r) {
  if constexpr (NC == 1) return acc[r][0];
  return _mm512_add_epi32(acc[r][0], acc[r][1]);
}

// The k-quant m of groups g and g + 1 (int8, 16 columns each at sm and sm + st) as 16 int16
// pairs (m_g[n], m_g+1[n]) in column n's 32-bit lane: vpdpwssd's operand against the rows'
// (xsum_g, xsum_g+1) pairs (GgufProblem::xsp).
static inline __attribute__((always_inline)) __m512i m_pairs(const int8_t* sm, int64_t st) {
  const __m128i a = _mm_loadu_si128((const __m128i*)sm), b = _mm_loadu_si128((const __m128i*)(sm + st));
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
}

// rows [m0, m0 + MR) against panel p (its lanes at `panel`: pb.qw's own, or expanded to 8-bit
// lanes, BITS = 8), BITS, G and the scheme (KQ: k-quant) fixed. Flat: every
// group scaled in float32 (s, z of float16; dx xsum from GgufProblem::dxs). k-quant: a
// super-block's groups summed in integers (sc isum by vpmulld; m xsum by vpdpwssd, two groups per
// instruction; |.| < 2^30) and scaled once per super-block by dx d and dx dmin (one activation
// scale per super-block). No division in the loops: row pointers are set up once, super-blocks
// and their groups are nested loops (as the avx2 path).
template <int MR, int BITS, int G, bool KQ>
static void panel_rows_vnni(const GgufProblem& pb, const uint8_t* panel, int64_t p, int64_t m0) {
  constexpr int NC = MR > 4 ? 1 : 2;
  const int64_t K = pb.K, ng = K / G;
  const int32_t* xi = (const int32_t*)(pb.xq + m0 * K);     // [K / 4][MR], as every operand below
  const float* dxi = pb.dx + m0 * (K / pb.QB);
  __m512 out[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) out[r] = _mm512_setzero_ps();
  constexpr int64_t kGroupBytes = G / chunk_k(BITS) * chunk_bytes(BITS);
  if constexpr (KQ) {
    const int64_t per_sb = pb.SB / G, nsb = K / pb.SB;      // per_sb is even (SB % 32 == 0, G <= 16 or 32)
    auto [st, mo, sm, dd] = KScales(pb, p);
    const int32_t* xspi = pb.xsp + m0 * (ng / 2);
    const uint8_t* pg = panel;
    int64_t g = 0;
    for (int64_t sb = 0; sb < nsb; ++sb, dd += st) {
      __m512i ks[MR], km[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) ks[r] = km[r] = _mm512_setzero_si512();
      for (int64_t j = 0; j < per_sb; ++j, ++g, sm += st, pg += kGroupBytes) {
        __m512i acc[MR][NC];
        group_dots_vnni<MR, NC, BITS, G>(pg, xi + g * (G / 4) * MR, acc);
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)sm));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) ks[r] = _mm512_add_epi32(ks[r], _mm512_mullo_epi32(group_isum(acc, r), sc));
        if (j % 2 == 1) {
          const __m512i mp = m_pairs(sm - st + mo, st);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) km[r] = _mm512_dpwssd_epi32(km[r], mp, _mm512_set1_epi32(xspi[g / 2 * MR + r]));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)dd));
      const __m512 dmin = pb.S == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + 16)))
                                    : _mm512_mul_ps(d, _mm512_set1_ps(32.f));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 dx = _mm512_set1_ps(dxi[sb * MR + r]);
        out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ks[r]), _mm512_mul_ps(d, dx), out[r]);
        out[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(km[r]), _mm512_mul_ps(dmin, dx), out[r]);
      }
    }
  } else {
    // flat: the activations' blocks are 32 values (QB), G = 16 or 32
    const uint16_t* hs = (const uint16_t*)pb.scales + p * ng * 32;
    const float* dxsi = pb.dxs + m0 * ng;
    const uint8_t* pg = panel;
    for (int64_t g = 0; g < ng; ++g, hs += 32, pg += kGroupBytes) {
      __m512i acc[MR][NC];
      group_dots_vnni<MR, NC, BITS, G>(pg, xi + g * (G / 4) * MR, acc);
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)hs));
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(hs + 16)));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 isum = _mm512_cvtepi32_ps(group_isum(acc, r));
        out[r] = _mm512_fmadd_ps(_mm512_mul_ps(isum, s), _mm512_set1_ps(dxi[g * G / 32 * MR + r]), out[r]);
        out[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(dxsi[g * MR + r]), out[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) store_row_avx512(pb, m0 + r, p, out[r]);
}

template <int BITS, int G, bool KQ>
static void panel_vnni_scheme(const GgufProblem& pb, const uint8_t* panel, int64_t p, int64_t m0, int mr) {
  switch (mr) {
    case 8: return panel_rows_vnni<8, BITS, G, KQ>(pb, panel, p, m0);
    case 7: return panel_rows_vnni<7, BITS, G, KQ>(pb, panel, p, m0);
    case 6: return panel_rows_vnni<6, BITS, G, KQ>(pb, panel, p, m0);
    case 5: return panel_rows_vnni<5, BITS, G, KQ>(pb, panel, p, m0);
    case 4: return panel_rows_vnni<4, BITS, G, KQ>(pb, panel, p, m0);
    case 3: return panel_rows_vnni<3, BITS, G, KQ>(pb, panel, p, m0);
    case 2: return panel_rows_vnni<2, BITS, G, KQ>(pb, panel, p, m0);
    default: return panel_rows_vnni<1, BITS, G, KQ>(pb, panel, p, m0);
  }
}

template <int BITS, int G>
static void panel_vnni(const GgufProblem& pb, const uint8_t* panel, int64_t p, int64_t m0, int mr) {
  return pb.supers != nullptr ? panel_vnni_scheme<BITS, G, true>(pb, panel, p, m0, mr)
                              : panel_vnni_scheme<BITS, G, false>(pb, panel, p, m0, mr);
}

// The panel's 4- or 6-bit chunks as 8-bit lanes (the bits-8 layout, 64-byte chunks of 4 k): row
// 2c holds k 8c..8c+3 of the 16 columns, row 2c + 1 k 8c+4..8c+7 (the w0, w1 of group_dots_vnni).
// Also AMX-INT8's B tile rows. out: K * 16 bytes, 64-byte aligned.
template <int BITS>
static void expand_panel_u8(const uint8_t* panel, int64_t K, uint8_t* out) {
  for (int64_t c = 0; c < K / 8; ++c) {
    __m512i w0, w1;
    chunk_operands<BITS>(panel + c * chunk_bytes(BITS), w0, w1);
    _mm512_store_si512(out + c * 128, w0);
    _mm512_store_si512(out + c * 128 + 64, w1);
  }
}

// rows [m0, m0 + mr) against panel p, its lanes at `panel`, `lanes` bits wide (pb.bits, or 8 when
// expanded by expand_panel_u8)
static void panel_rows_avx512vnni(const GgufProblem& pb, const uint8_t* panel, int lanes, int64_t p, int64_t m0, int mr) {
  if (lanes == 4) return pb.G == 32 ? panel_vnni<4, 32>(pb, panel, p, m0, mr) : panel_vnni<4, 16>(pb, panel, p, m0, mr);
  if (lanes == 6) return pb.G == 32 ? panel_vnni<6, 32>(pb, panel, p, m0, mr) : panel_vnni<6, 16>(pb, panel, p, m0, mr);
  return pb.G == 32 ? panel_vnni<8, 32>(pb, panel, p, m0, mr) : panel_vnni<8, 16>(pb, panel, p, m0, mr);
}
// The avx512vnni register block of row m (of M): its first row and its row count. Blocks of
// kMRVnni from 0 within cache blocks of kMC rows (a multiple of kMRVnni): a block's rows are
// min(kMRVnni, M - first row).
static inline std::pair<int64_t, int> vnni_block(int64_t m, int64_t M) {
  const int64_t b0 = m / kMRVnni * kMRVnni;
  return {b0, (int)std::min<int64_t>(kMRVnni, M - b0)};
}

// Row r of an mr-row register block into the block's interleaved array (dst: the block's start):
// dst[i * mr + r] = src[i] for i < n.
template <typename T>
static inline void interleave_row(const T* src, int64_t n, T* dst, int mr, int r) {
  for (int64_t i = 0; i < n; ++i) dst[i * mr + r] = src[i];
}

// A row's per-group operands of the avx512vnni path from its quantized x: flat, dxs[g] = dx of
// the group's block * xsum (the float32 product the scaling uses); k-quant, xsp[j] = the int16
// pair (xsum of group 2j, of group 2j + 1). xs16: [K / 16]; dx: [K / 32] (flat).
static void group_operands(const int32_t* xs16, const float* dx, int64_t K, int64_t G, bool kq, float* dxs,
                           int32_t* xsp) {
  const int64_t ng = K / G;
  auto xsum = [&](int64_t g) { return G == 32 ? xs16[2 * g] + xs16[2 * g + 1] : xs16[g]; };
  if (kq) {
    for (int64_t j = 0; j < ng / 2; ++j)
      xsp[j] = (int32_t)(((uint32_t)(uint16_t)(int16_t)xsum(2 * j)) | ((uint32_t)(uint16_t)(int16_t)xsum(2 * j + 1) << 16));
  } else {
    for (int64_t g = 0; g < ng; ++g) dxs[g] = dx[g * G / 32] * (float)xsum(g);
  }
}

static inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16(const uint16_t* x) { return kvmesh::bf16x16_f32(x); }

template <typename T>
static void quantize_rows_avx512(const T* x, int64_t K, int64_t QB, int8_t* xq, float* dx, int32_t* xs16) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < K / QB; ++b) {
    const T* xb = x + b * QB;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = 0; i < QB; i += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(load16(xb + i), absmask));
    const float amax = _mm512_reduce_max_ps(mx);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    dx[b] = amax / 127.f;
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < QB; i += 16) {
      // cvtps2dq rounds to nearest even under the default MXCSR
      const __m512i q = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(load16(xb + i), iv))));
      _mm_storeu_si128((__m128i*)(xq + b * QB + i), _mm512_cvtepi32_epi8(q));
      xs16[(b * QB + i) / 16] = _mm512_reduce_add_epi32(q);
    }
  }
}
#pragma GCC pop_options

// ---- AMX-INT8 -------------------------------------------------------------------------------
// Rows in blocks of 16 (x's int8 rows padded with zeros to a multiple of 16) against one panel
// at a time: TDPBSUD multiplies an A tile of 16 rows x G int8 activations (xq itself, row stride
// K) by a B tile of G / 4 rows x 16 columns x 4 unsigned weights -- the rows of the panel's
// vpdpbusd operands (w0, w1 of each chunk), expanded to bytes once per panel and row chunk
// (8-bit lanes are that layout already and are read from the panel) -- into a C tile of the
// group's isum (16 rows x 16 columns, int32, exact). C goes through memory (tilestored) to the
// AVX-512 scaling, which is the VNNI path's, operation for operation: the outputs are bitwise
// those of the avx512vnni path. k-quant: the super-block's m xsum = sum_k xq[k] m_g(k)[n] is
// itself a product, of x (A tiles of 64 k) and a B tile holding each group's m (or sc, Q6_K's
// form) in every row of its k: TDPBSSD, once per 64 k, no per-group vector work. Tiles: tmm0
// C of a group, tmm1 C of m xsum, tmm2 A (16 x G), tmm3 B (G / 4 x 64), tmm4 A (16 x 64),
// tmm5 B of m (16 x 64).
#pragma GCC push_options
// (every CPU with AMX has AVX512-BF16: the bf16 route's dequantization rounds with vcvtne2ps2bf16)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,f16c,fma,amx-tile,amx-int8")


struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
// static objects: GCC 12 drops stores into a stack copy before ldtilecfg (micro_amx.cpp)
const AmxTileConfig kAmxTiles32 = {1, 0, {}, {64, 64, 32, 32, 64, 64, 64, 64}, {16, 16, 16, 16, 8, 8, 16, 8}};
const AmxTileConfig kAmxTiles16 = {1, 0, {}, {64, 64, 16, 16, 64, 64, 64, 64}, {16, 16, 16, 16, 4, 4, 16, 4}};

// Per thread: the panel's weights as B tile rows (K / 4 x 64 bytes), the k-quant m per k
// (K / 4 x 64 int8), a super-block's group results and m xsum, the row block's outputs.
struct AmxScratch {
  std::vector<uint8_t> bt;
  std::vector<int8_t> bm;
  alignas(64) int32_t c[16][16][16];      // [group of the super-block][row][column]
  alignas(64) int32_t km[16][16];
  alignas(64) float out[16][16];
};

// The k-quant m of every k as B tile rows of 16 columns x 4 k: the group's m (int8) in every
// byte of its column's lane, G / 4 identical rows per group.
static void amx_expand_m(const GgufProblem& pb, int64_t p, int8_t* bm) {
  const int64_t ng = pb.K / pb.G, st = 16 * pb.S, mo = pb.S == 2 ? 16 : 0;
  const int8_t* sm = (const int8_t*)pb.scales + p * ng * st + mo;
  const __m512i spread = _mm512_set1_epi32(0x01010101);
  for (int64_t g = 0; g < ng; ++g, sm += st) {
    const __m512i row = _mm512_mullo_epi32(_mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)sm)),
                                                            _mm512_set1_epi32(0xFF)), spread);
    for (int i = 0; i < pb.G / 4; ++i) _mm512_store_si512(bm + (g * pb.G / 4 + i) * 64, row);
  }
}

// Rows [m0, m0 + 16) (x padded) against panel p: the group products in tiles, the scaling as
// panel_rows_vnni's; rows < M are stored.
template <int G, bool KQ>
static void amx_row_block(const GgufProblem& pb, int64_t p, int64_t m0, const uint8_t* bt,
                          const int8_t* bm, AmxScratch& sc) {
  const int64_t K = pb.K, ng = K / G;
  const int8_t* xa = pb.xq + m0 * K;
  const int rows = (int)std::min<int64_t>(16, pb.M - m0);
  for (int r = 0; r < 16; ++r) _mm512_store_ps(sc.out[r], _mm512_setzero_ps());
  if constexpr (KQ) {
    const int64_t per_sb = pb.SB / G, nsb = K / pb.SB;
    auto [st, mo, sm, dd] = KScales(pb, p);
    for (int64_t sb = 0; sb < nsb; ++sb, dd += st) {
      const int64_t k0 = sb * pb.SB;
      _tile_zero(6);
      for (int64_t j = 0; j < per_sb; j += 2) {      // two groups in flight (per_sb is even)
        const int64_t k = k0 + j * G;
        _tile_loadd(2, xa + k, K);
        _tile_loadd(4, bt + k * 16, 64);
        _tile_loadd(3, xa + k + G, K);
        _tile_loadd(5, bt + (k + G) * 16, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
        _tile_loadd(7, bm + k * 16, 64);
        _tile_dpbssd(6, 2, 7);
        _tile_stored(0, sc.c[j], 64);
        _tile_loadd(7, bm + (k + G) * 16, 64);
        _tile_dpbssd(6, 3, 7);
        _tile_stored(1, sc.c[j + 1], 64);
      }
      _tile_stored(6, sc.km, 64);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)dd));
      const __m512 dmin = pb.S == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dd + 16)))
                                    : _mm512_mul_ps(d, _mm512_set1_ps(32.f));
      const int8_t* smj = sm;
      __m512i scv[16];
      for (int64_t j = 0; j < per_sb; ++j, smj += st) scv[j] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)smj));
      sm = smj;
      for (int r = 0; r < rows; ++r) {
        __m512i ks = _mm512_setzero_si512();
        for (int64_t j = 0; j < per_sb; ++j) ks = _mm512_add_epi32(ks, _mm512_mullo_epi32(_mm512_load_si512(sc.c[j][r]), scv[j]));
        const __m512i km = _mm512_load_si512(sc.km[r]);
        const __m512 dx = _mm512_set1_ps(pb.dx[(m0 + r) * (K / pb.QB) + sb]);
        __m512 o = _mm512_load_ps(sc.out[r]);
        o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ks), _mm512_mul_ps(d, dx), o);
        o = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(km), _mm512_mul_ps(dmin, dx), o);
        _mm512_store_ps(sc.out[r], o);
      }
    }
  } else {
    const uint16_t* hs = (const uint16_t*)pb.scales + p * ng * 32;
    for (int64_t g = 0; g < ng; ++g, hs += 32) {
      if (g % 2 == 0) {                        // two groups in flight
        _tile_loadd(2, xa + g * G, K);
        _tile_loadd(4, bt + g * G * 16, 64);
        _tile_zero(0);
        _tile_dpbsud(0, 2, 4);
        if (g + 1 < ng) {
          _tile_loadd(3, xa + (g + 1) * G, K);
          _tile_loadd(5, bt + (g + 1) * G * 16, 64);
          _tile_zero(1);
          _tile_dpbsud(1, 3, 5);
        }
        _tile_stored(0, sc.c[0], 64);
        if (g + 1 < ng) _tile_stored(1, sc.c[1], 64);
      }
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)hs));
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(hs + 16)));
      for (int r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const float dx = pb.dx[m * (K / 32) + g * G / 32];
        const int32_t xsum = group_xsum<G>(pb.xs16 + m * (K / 16), g);
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sc.c[g % 2][r]));
        __m512 o = _mm512_load_ps(sc.out[r]);
        o = _mm512_fmadd_ps(_mm512_mul_ps(isum, s), _mm512_set1_ps(dx), o);
        o = _mm512_fmadd_ps(z, _mm512_set1_ps(dx * (float)xsum), o);
        _mm512_store_ps(sc.out[r], o);
      }
    }
  }
  for (int r = 0; r < rows; ++r) store_row_avx512(pb, m0 + r, p, _mm512_load_ps(sc.out[r]));
}

// Panels [p0, p1) for every row (pb.xq padded to a multiple of 16 rows): rows in chunks of at
// most kAmxXBytes of x, each panel expanded once per chunk.
static void amx_panels(const GgufProblem& pb, int64_t p0, int64_t p1) {
  const int64_t K = pb.K, Mp = (pb.M + 15) / 16 * 16;
  const int64_t mc = std::max<int64_t>(16, kAmxXBytes / K / 16 * 16);
  const bool kq = pb.supers != nullptr;
  AmxScratch sc;
  sc.bt.resize(pb.bits == 8 ? 0 : K * 16 + 64);
  sc.bm.resize(kq ? K * 16 + 64 : 0);
  uint8_t* bt0 = (uint8_t*)(((uintptr_t)sc.bt.data() + 63) & ~(uintptr_t)63);
  int8_t* bm = (int8_t*)(((uintptr_t)sc.bm.data() + 63) & ~(uintptr_t)63);
  _tile_loadconfig(pb.G == 32 ? &kAmxTiles32 : &kAmxTiles16);
  for (int64_t mb = 0; mb < Mp; mb += mc) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = pb.qw + p * K * pb.bits * 2;
      const uint8_t* bt = panel;           // 8-bit lanes: the panel is the B layout
      if (pb.bits == 4) expand_panel_u8<4>(panel, K, bt0), bt = bt0;
      if (pb.bits == 6) expand_panel_u8<6>(panel, K, bt0), bt = bt0;
      if (kq) amx_expand_m(pb, p, bm);
      for (int64_t m = mb; m < std::min(Mp, mb + mc); m += 16) {
        if (pb.G == 32) kq ? amx_row_block<32, true>(pb, p, m, bt, bm, sc) : amx_row_block<32, false>(pb, p, m, bt, bm, sc);
        else kq ? amx_row_block<16, true>(pb, p, m, bt, bm, sc) : amx_row_block<16, false>(pb, p, m, bt, bm, sc);
      }
    }
  }
  _tile_release();
  at::native::cpublas::brgemm_release();   // ATen's AMX GEMMs: their tile configuration is gone
}

// ---- AMX-BF16 for bfloat16 x: the panels dequantized, TDPBF16PS ----------------------------
// For bfloat16 activations of kAmxBf16MinRows rows or more, the int8 route above is bound by
// its per-group work (a C tile through memory and a vector scaling per group of 16-32 k), well
// behind the dense bfloat16 conversion's AMX GEMM on a cold prefill. This route dequantizes a pair of panels per row chunk
// to bfloat16 (w = s q + z in float32, rounded to nearest even: the values of the dense
// conversion) in the bf16 GEMM's VNNI-2 layout (micro.h) and multiplies x as it is with the bf16
// GEMM's AMX block kernel (micro_amx.cpp): no activation quantization, float32 sums; the
// reference is dequantize-then-matmul (workers/kernels/reference.py gguf_linear_bf16_ref).
// From 32 rows the bf16 route beats the int8 one (figures: docs/engine.md, "Kernel constants and the measurements behind them").
constexpr int64_t kAmxBf16MinRows = 32;

// Panel p dequantized: out[t][c][j] = bf16(W[16 p + c][2 t + j]), uint16 [K / 2][16][2].
template <int BITS>
static void dequant_panel_bf16(const GgufProblem& pb, int64_t p, uint16_t* out) {
  const int64_t K = pb.K, ng = K / pb.G;
  const uint8_t* panel = pb.qw + p * K * BITS * 2;
  const __m512i b255 = _mm512_set1_epi32(0xFF);
  // k-pair interleave of vcvtne2ps2bf16's [16 of k even | 16 of k odd] halves: column c's pair
  // (k even, k odd) into its 32-bit lane
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // 4 consecutive k of the 16 columns (w's lanes) -> two k-pair rows of out, each weight rounded
  // to nearest even (vcvtne2ps2bf16)
  auto emit = [&](__m512i w, __m512 s, __m512 z, uint16_t* o) {
    __m512 f[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8 * j), b255)), s, z);
    const __m512i p01 = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), p23 = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
    _mm512_store_si512(o, _mm512_permutexvar_epi16(pairs, p01));
    _mm512_store_si512(o + 32, _mm512_permutexvar_epi16(pairs, p23));
  };
  alignas(64) float s[16], z[16];
  for (int64_t g = 0; g < ng; ++g) {
    group_sz(pb, p, g, s, z);
    const __m512 sv = _mm512_load_ps(s), zv = _mm512_load_ps(z);
    for (int64_t k = g * pb.G; k < (g + 1) * pb.G; k += chunk_k(BITS)) {
      const uint8_t* pc = panel + k / chunk_k(BITS) * chunk_bytes(BITS);
      uint16_t* o = out + k * 16;
      if constexpr (BITS == 8) {
        emit(_mm512_loadu_si512(pc), sv, zv, o);
      } else {
        __m512i w0, w1;
        chunk_operands<BITS>(pc, w0, w1);
        emit(w0, sv, zv, o);
        emit(w1, sv, zv, o + 64);
      }
    }
  }
}

// Panel pairs [q0, q1) (pair q: panels 2q, 2q + 1) for every row of the bfloat16 x (xb: M rows of
// K; xtail: the rows past the last whole 16-row tile, 16 rows with zeros past M, or nullptr when
// 16 divides M: the tiles read whole 16-row blocks), rows in chunks whose x stays in L2, but at least 256
// rows, so that the dequantization of a pair is spread over enough rows (down_proj, K = 8960, one
// thread, M = 256: 107 GMAC/s in chunks of 32 rows, 302 in chunks of 256).
static void amx_bf16_pairs(const GgufProblem& pb, const uint16_t* xb, const uint16_t* xtail, int64_t q0, int64_t q1) {
  const int64_t K = pb.K, M = pb.M, M16 = M / 16 * 16;
  const int64_t mc = std::max<int64_t>(256, kAmxXBytes / (K * 2) / 32 * 32);
  std::vector<uint16_t> wv(2 * K * 16 + 32);
  uint16_t* w = (uint16_t*)(((uintptr_t)wv.data() + 63) & ~(uintptr_t)63);
  alignas(64) float tile[32 * 32];
  uint16_t* y = (uint16_t*)pb.y;         // bfloat16 [M, 16 P] (this route's x and y are bfloat16)
  auto bias = [&](int64_t p) { return pb.bias != nullptr ? _mm512_loadu_ps(pb.bias + p * 16) : _mm512_setzero_ps(); };
  const AmxTable& amx = amx_table();
  amx_configure();
  for (int64_t mb = 0; mb < M; mb += mc) {
    for (int64_t q = q0; q < q1; ++q) {
      const int np = 2 * q + 1 < pb.P ? 2 : 1;
      for (int i = 0; i < np; ++i) {
        uint16_t* o = w + i * K * 16;
        if (pb.bits == 4) dequant_panel_bf16<4>(pb, 2 * q + i, o);
        else if (pb.bits == 6) dequant_panel_bf16<6>(pb, 2 * q + i, o);
        else dequant_panel_bf16<8>(pb, 2 * q + i, o);
      }
      // tiles (1 or 2 blocks of 16 rows from x) for rows [r0, r0 + rows), stored as bfloat16
      // (vcvtneps2bf16: nearest even, as store_row_avx512) with the bias
      const __m512 b0 = bias(2 * q), b1 = np > 1 ? bias(2 * q + 1) : b0;
      auto block = [&](const uint16_t* xr, int mbk, int64_t r0, int rows) {
        amx.fn[mbk][np](xr, K, w, K * 16, K / 2, tile);
        for (int rr = 0; rr < rows; ++rr) {
          uint16_t* yr = y + (r0 + rr) * pb.P * 16 + 2 * q * 16;
          const float* tr = tile + rr * np * 16;
          _mm256_storeu_si256((__m256i*)yr, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(tr), b0)));
          if (np > 1)
            _mm256_storeu_si256((__m256i*)(yr + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(tr + 16), b1)));
        }
      };
      amx_row_blocks(xb, K, xtail, M16, M, mb, std::min(M, mb + mc), block);
    }
  }
  amx_release();
}
#pragma GCC pop_options

// ---- AVX2 -----------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// acc[r][h] = mul x the integer dot products q . xq of one group (G values of k) for rows r < MR,
// columns 8h .. 8h + 7 (h = 0, 1), int32; mul[h]: the columns' int16 multipliers, each in both
// halves of its 32-bit lane (vpmaddwd: ones, or the k-quant group scales sc). 4-bit lanes sum a whole group's vpmaddubsw pairs in
// int16 before widening (8 products of 2 x 15 x 127 stay below 2^15); 6-bit lanes widen per
// chunk (2 x 63 x 127 per product: two fit); 8-bit lanes are taken as the signed q - 128 with
// the sign moved onto x (|q - 128| x 127 x 2 < 2^15), so acc is sum (q - 128) xq for them.
template <int MR, int BITS, int G>
static inline __attribute__((always_inline)) void group_dots_avx2(const uint8_t* pg, const int32_t* const* xq4,
                                                                  int64_t q0, const __m256i (&mul)[2],
                                                                  __m256i (&acc)[MR][2]) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  constexpr int kChunks = G / chunk_k(BITS), kCB = chunk_bytes(BITS);
  prefetch_ahead<kChunks * kCB>(pg);
  // The chunk loops stay rolled: unrolled, GCC re-associates the sums across chunks into trees
  // that keep every product live, and spills most of them (seen in the disassembly at MR 4).
  if constexpr (BITS == 4) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {      // one half at a time: 4 int16 sums + operands fit 16 registers
      __m256i p16[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) p16[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int c = 0; c < kChunks; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(pg + c * kCB + 32 * h));
        const __m256i w0 = _mm256_and_si256(v, lo4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i x0 = _mm256_set1_epi32(xq4[r][q0 + 2 * c]), x1 = _mm256_set1_epi32(xq4[r][q0 + 2 * c + 1]);
          p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(w0, x0));
          p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(w1, x1));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][h] = _mm256_madd_epi16(p16[r], mul[h]);
    }
  } else if constexpr (BITS == 6) {
    const __m256i lo2 = _mm256_set1_epi8(0x03);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int c = 0; c < kChunks; ++c) {
      const uint8_t* ch = pg + c * kCB;
      const __m256i h0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(ch + 64)));
      const __m256i h1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(ch + 80)));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        // operand bytes 32h .. 32h + 31 are 128-bit lanes l = 2h, 2h + 1: high bits at 2l, 2l + 1
        const __m256i sh = _mm256_set_epi64x(4 * h + 2, 4 * h + 2, 4 * h, 4 * h);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(ch + 32 * h));
        const __m256i w0 = _mm256_or_si256(_mm256_and_si256(v, lo4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi64(h0, sh), lo2), 4));
        const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi64(h1, sh), lo2), 4));
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i x0 = _mm256_set1_epi32(xq4[r][q0 + 2 * c]), x1 = _mm256_set1_epi32(xq4[r][q0 + 2 * c + 1]);
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(p16, mul[h]));
        }
      }
    }
  } else {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int c = 0; c < kChunks; ++c) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(pg + c * kCB + 32 * h)), flip);
        const __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(xq4[r][q0 + c]), w);
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), mul[h]));
        }
      }
    }
  }
}

// rows [m0, m0 + MR) against panel p, BITS, G and the scheme (KQ: k-quant) fixed. Flat: every
// group scaled in float32 (s, z of float16). k-quant: as the vnni path, a super-block's groups
// summed in integers (sc isum, m xsum) and scaled once by dx d, dx dmin. No division in the
// loops: row pointers are set up once, super-blocks and their groups are nested loops.
template <int MR, int BITS, int G, bool KQ>
static void panel_rows_avx2(const GgufProblem& pb, int64_t p, int64_t m0) {
  const int64_t K = pb.K, ng = K / G, pbytes = K * BITS * 2;
  const uint8_t* panel = pb.qw + p * pbytes;
  const RowPointers<MR> rows(pb, m0);
  const auto &xq4 = rows.xq4, &dxr = rows.dx, &xsr = rows.xs16;
  __m256 out[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  constexpr int64_t kGroupBytes = G / chunk_k(BITS) * chunk_bytes(BITS);
  if constexpr (KQ) {
    const int64_t per_sb = pb.SB / G, nsb = K / pb.SB;
    auto [st, mo, sm, dd] = KScales(pb, p);
    for (int64_t sb = 0; sb < nsb; ++sb, dd += st) {
      __m256i ks[MR][2], km[MR][2];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) ks[r][0] = ks[r][1] = km[r][0] = km[r][1] = _mm256_setzero_si256();
      for (int64_t g = sb * per_sb; g < (sb + 1) * per_sb; ++g, sm += st) {
        __m256i sc[2], acc[MR][2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {      // sc in both 16-bit halves of each column's lane
          const __m256i s32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sm + 8 * h)));
          sc[h] = _mm256_blend_epi16(s32, _mm256_slli_epi32(s32, 16), 0xAA);
        }
        group_dots_avx2<MR, BITS, G>(panel + g * kGroupBytes, xq4, g * G / 4, sc, acc);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i mn = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sm + mo + 8 * h)));
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const int32_t xsum = group_xsum<G>(xsr[r], g);
            __m256i a = acc[r][h];
            if constexpr (BITS == 8) {       // acc summed sc (q - 128) xq
              a = _mm256_add_epi32(a, _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sm + 8 * h))),
                                                         _mm256_set1_epi32(128 * xsum)));
            }
            ks[r][h] = _mm256_add_epi32(ks[r][h], a);
            km[r][h] = _mm256_add_epi32(km[r][h], _mm256_mullo_epi32(mn, _mm256_set1_epi32(xsum)));
          }
        }
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dd + 8 * h)));
        const __m256 dmin = pb.S == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dd + 16 + 8 * h)))
                                      : _mm256_mul_ps(d, _mm256_set1_ps(32.f));
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256 dx = _mm256_set1_ps(dxr[r][sb]);
          out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ks[r][h]), _mm256_mul_ps(d, dx), out[r][h]);
          out[r][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(km[r][h]), _mm256_mul_ps(dmin, dx), out[r][h]);
        }
      }
    }
  } else {
    // flat: the activations' blocks are 32 values (QB), G = 16 or 32
    const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
    const uint16_t* hs = (const uint16_t*)pb.scales + p * ng * 32;
    for (int64_t g = 0; g < ng; ++g, hs += 32) {
      __m256i acc[MR][2];
      group_dots_avx2<MR, BITS, G>(panel + g * kGroupBytes, xq4, g * G / 4, ones, acc);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(hs + 8 * h)));
        __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(hs + 16 + 8 * h)));
        if constexpr (BITS == 8) zv = _mm256_fmadd_ps(_mm256_set1_ps(128.f), sv, zv);    // acc summed q - 128
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const float dx = dxr[r][g * G / 32];
          const int32_t xsum = group_xsum<G>(xsr[r], g);
          const __m256 isum = _mm256_cvtepi32_ps(acc[r][h]);
          out[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(isum, sv), _mm256_set1_ps(dx), out[r][h]);
          out[r][h] = _mm256_fmadd_ps(zv, _mm256_set1_ps(dx * (float)xsum), out[r][h]);
        }
      }
    }
  }
  alignas(32) float row[16];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(row, out[r][0]);
    _mm256_store_ps(row + 8, out[r][1]);
    store_row_scalar(pb, m0 + r, p, row);
  }
}

static inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
static inline __m256 load8(const uint16_t* x) { return kvmesh::bf16x8_f32(x); }

// quantize_rows_scalar's results (the same rounding: cvtps2dq rounds half to even under the
// default MXCSR, as nearbyint)
template <typename T>
static void quantize_rows_avx2(const T* x, int64_t K, int64_t QB, int8_t* xq, float* dx, int32_t* xs16) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t b = 0; b < K / QB; ++b) {
    const T* xb = x + b * QB;
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = 0; i < QB; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8(xb + i), absmask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    dx[b] = amax / 127.f;
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < QB; i += 16) {
      const __m256i q0 = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(load8(xb + i), iv))));
      const __m256i q1 = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(load8(xb + i + 8), iv))));
      const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);    // 16 x int16 in order
      _mm_storeu_si128((__m128i*)(xq + b * QB + i),
                       _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
      const __m256i s8 = _mm256_add_epi32(q0, q1);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      xs16[(b * QB + i) / 16] = _mm_cvtsi128_si32(s4);
    }
  }
}

template <int BITS, int G>
static void panel_avx2(const GgufProblem& pb, int64_t p, int64_t m0, int mr) {
  const bool kq = pb.supers != nullptr;
  switch (mr) {
    case 4: return kq ? panel_rows_avx2<4, BITS, G, true>(pb, p, m0) : panel_rows_avx2<4, BITS, G, false>(pb, p, m0);
    case 3: return kq ? panel_rows_avx2<3, BITS, G, true>(pb, p, m0) : panel_rows_avx2<3, BITS, G, false>(pb, p, m0);
    case 2: return kq ? panel_rows_avx2<2, BITS, G, true>(pb, p, m0) : panel_rows_avx2<2, BITS, G, false>(pb, p, m0);
    default: return kq ? panel_rows_avx2<1, BITS, G, true>(pb, p, m0) : panel_rows_avx2<1, BITS, G, false>(pb, p, m0);
  }
}

static void panel_rows_avx2_any(const GgufProblem& pb, int64_t p, int64_t m0, int mr) {
  if (pb.bits == 4) return pb.G == 32 ? panel_avx2<4, 32>(pb, p, m0, mr) : panel_avx2<4, 16>(pb, p, m0, mr);
  if (pb.bits == 6) return pb.G == 32 ? panel_avx2<6, 32>(pb, p, m0, mr) : panel_avx2<6, 16>(pb, p, m0, mr);
  return pb.G == 32 ? panel_avx2<8, 32>(pb, p, m0, mr) : panel_avx2<8, 16>(pb, p, m0, mr);
}
#pragma GCC pop_options
#endif  // __x86_64__

enum class Path { kScalar, kAvx2, kAvx512Vnni, kAmx };
const char* const kPathNames[] = {"scalar", "avx2", "avx512vnni", "amx"};

// The path at level `isa`: amx needs AMX-INT8 too (else avx512vnni), avx512vnni (at avx512 and
// above) AVX512-VNNI (else avx2).
Path path_at(kvmesh::Isa isa) {
#if defined(__x86_64__)
  using kvmesh::Isa;
  const bool vnni = kvmesh::cpu_has_avx512vnni();
  if (isa >= Isa::kAmx && vnni && kvmesh::cpu_has_amx_int8()) return Path::kAmx;
  if (isa >= Isa::kAvx512 && vnni) return Path::kAvx512Vnni;
  if (isa >= Isa::kAvx2) return Path::kAvx2;
#endif
  (void)isa;
  return Path::kScalar;
}

at::Tensor gguf_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& superscales, int64_t bits, int64_t group_size, int64_t n,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gguf_linear: x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "gguf_linear: bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(group_size == 16 || group_size == 32, "gguf_linear: group_size must be 16 or 32, got ", group_size);
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  TORCH_CHECK(K % 32 == 0, "gguf_linear: K (", K, ") must be a multiple of 32");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "gguf_linear: qweight must be contiguous uint8 [P, K * bits * 2]");
  const int64_t P = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K * bits * 2, "gguf_linear: qweight holds ", qweight.size(1), " bytes per panel, x has K = ",
              K, " (", K * bits * 2, " bytes at ", bits, " bits)");
  TORCH_CHECK(n > 0 && n <= P * 16, "gguf_linear: N (", n, ") must be in (0, ", P * 16, "]");
  const bool kq = superscales.has_value();
  const int64_t S = kq ? scales.size(2) : 2;
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 4 && scales.size(0) == P && scales.size(1) == K / G &&
                  (S == 2 || (kq && S == 1)) && scales.size(3) == 16 &&
                  scales.scalar_type() == (kq ? at::kChar : at::kHalf),
              "gguf_linear: scales must be contiguous ", kq ? "int8 [P, K / G, 2 or 1, 16]" : "float16 [P, K / G, 2, 16]",
              " with P = ", P, ", K / G = ", K / G, ", got ", scales.scalar_type(), " ", scales.sizes());
  int64_t SB = 0;
  if (kq) {
    const at::Tensor& ss = *superscales;
    TORCH_CHECK(ss.is_contiguous() && ss.dim() == 4 && ss.scalar_type() == at::kHalf && ss.size(0) == P &&
                    ss.size(1) > 0 && K % ss.size(1) == 0 && ss.size(2) == S && ss.size(3) == 16,
                "gguf_linear: superscales must be contiguous float16 [P, K / SB, ", S, ", 16] (as scales' third "
                "dimension), got ", ss.scalar_type(), " ", ss.sizes());
    SB = K / ss.size(1);
    TORCH_CHECK(SB % G == 0 && SB % 32 == 0, "gguf_linear: the super-block (", SB, ") must be a multiple of 32 and of G");
  }
  const at::Tensor xc = x.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor bias_f;      // float32 [16 P], zero past N
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "gguf_linear: bias must be [N] = [", n, "], got ", bias->sizes());
    bias_f = at::zeros({P * 16}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, n).copy_(*bias);
  }
  at::Tensor y = at::empty({M, P * 16}, x.options());
  // the activations' blocks: 32 values (flat scheme, as llama.cpp's q8_0), or the k-quant
  // super-block (as its q8_K), so that the vnni path sums a super-block's groups in integers
  const int64_t QB = kq ? SB : 32;
  Path path = path_at(kvmesh::active_isa());
#if defined(__x86_64__)
  if (path == Path::kAmx && bf16 && M >= kAmxBf16MinRows) {    // bfloat16 x: dequantized panels, AMX-BF16
    const int64_t M16 = M / 16 * 16;
    std::vector<uint16_t> tail(M16 < M ? 16 * K : 0, 0);      // the tiles read whole 16-row blocks
    if (M16 < M) std::memcpy(tail.data(), (const uint16_t*)xc.data_ptr<at::BFloat16>() + M16 * K, (M - M16) * K * 2);
    const GgufProblem pb{nullptr, nullptr, 0, nullptr, nullptr, nullptr, M, K, qweight.data_ptr<uint8_t>(), scales.data_ptr(),
                         kq ? (const uint16_t*)superscales->data_ptr<at::Half>() : nullptr, S, P, (int)bits, (int)G, (int)SB,
                         y.data_ptr(), true, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr};
    const uint16_t* xp = (const uint16_t*)xc.data_ptr<at::BFloat16>();
    const uint16_t* xt = M16 < M ? tail.data() : nullptr;
    at::parallel_for(0, (P + 1) / 2, 2, [&](int64_t q0, int64_t q1) { amx_bf16_pairs(pb, xp, xt, q0, q1); });
    return n == P * 16 ? y : y.narrow(1, 0, n);
  }
#endif
  // AMX-INT8: kAmxMinRows rows or more, and (k-quant) super-blocks of whole 64-k A tiles and <= 16 groups
  const bool amx = path == Path::kAmx && M >= kAmxMinRows && (!kq || (SB % 64 == 0 && SB / G <= 16));
  if (path == Path::kAmx && !amx) path = Path::kAvx512Vnni;
  const int64_t Mp = amx ? (M + 15) / 16 * 16 : M;     // AMX tiles read 16 rows: zero rows past M
  std::vector<int8_t> xq(Mp * K);
  std::vector<float> dx(Mp * (K / QB));
  // avx512vnni: its per-group operands (GgufProblem::dxs, xsp) instead of xs16, and every operand
  // interleaved per register block (vnni_block)
  const int64_t ng = K / G;
  const bool vnni = path == Path::kAvx512Vnni;
  std::vector<int32_t> xs16(vnni ? 0 : Mp * (K / 16));
  std::vector<float> dxs(vnni && !kq ? M * ng : 0);
  std::vector<int32_t> xsp(vnni && kq ? M * (ng / 2) : 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(bf16 ? K : 0);
    // avx512vnni: a row quantized here, then interleaved into its register block
    std::vector<int8_t> q1(vnni ? K : 0);
    std::vector<float> d1(vnni ? K / QB : 0), dxs1(vnni && !kq ? ng : 0);
    std::vector<int32_t> s1(vnni ? K / 16 : 0), xsp1(vnni && kq ? ng / 2 : 0);
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* q = vnni ? q1.data() : xq.data() + m * K;
      float* d = vnni ? d1.data() : dx.data() + m * (K / QB);
      int32_t* s16 = vnni ? s1.data() : xs16.data() + m * (K / 16);
#if defined(__x86_64__)
      if (path == Path::kAvx512Vnni || path == Path::kAmx) {
        if (bf16) quantize_rows_avx512((const uint16_t*)xc.data_ptr<at::BFloat16>() + m * K, K, QB, q, d, s16);
        else quantize_rows_avx512(xc.data_ptr<float>() + m * K, K, QB, q, d, s16);
        if (vnni) {
          group_operands(s16, d, K, G, kq, dxs1.data(), xsp1.data());
          const auto [b0, mr] = vnni_block(m, M);
          const int r = (int)(m - b0);
          interleave_row((const int32_t*)q, K / 4, (int32_t*)(xq.data() + b0 * K), mr, r);
          interleave_row(d, K / QB, dx.data() + b0 * (K / QB), mr, r);
          if (kq) interleave_row(xsp1.data(), ng / 2, xsp.data() + b0 * (ng / 2), mr, r);
          else interleave_row(dxs1.data(), ng, dxs.data() + b0 * ng, mr, r);
        }
        continue;
      }
      if (path == Path::kAvx2) {
        if (bf16) quantize_rows_avx2((const uint16_t*)xc.data_ptr<at::BFloat16>() + m * K, K, QB, q, d, s16);
        else quantize_rows_avx2(xc.data_ptr<float>() + m * K, K, QB, q, d, s16);
        continue;
      }
#endif
      if (bf16) {
        const at::BFloat16* xb = xc.data_ptr<at::BFloat16>() + m * K;
        for (int64_t k = 0; k < K; ++k) row[k] = (float)xb[k];
        quantize_rows_scalar(row.data(), K, QB, q, d, s16);
      } else {
        quantize_rows_scalar(xc.data_ptr<float>() + m * K, K, QB, q, d, s16);
      }
    }
  });
  GgufProblem pb{xq.data(), dx.data(), QB, vnni ? nullptr : xs16.data(), kq ? nullptr : dxs.data(), kq ? xsp.data() : nullptr, M, K, qweight.data_ptr<uint8_t>(), scales.data_ptr(),
                 kq ? (const uint16_t*)superscales->data_ptr<at::Half>() : nullptr, S, P, (int)bits, (int)G, (int)SB, y.data_ptr(), bf16,
                 bias_f.defined() ? bias_f.data_ptr<float>() : nullptr};
#if defined(__x86_64__)
  if (amx) {
    at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) { amx_panels(pb, p0, p1); });
    return n == P * 16 ? y : y.narrow(1, 0, n);
  }
  // avx512vnni: rows in register blocks of kMRVnni, a cache block's last rows as one block (so that
  // a speculative verify pass of 1 + 4 tokens unpacks each weight chunk once: docs/engine.md,
  // "Kernel constants and the measurements behind them"); a cache block of kVnniExpandRows rows or
  // more reads each 6-bit panel expanded to 8-bit lanes once (expand_panel_u8), its register
  // blocks then load their operands with no unpacking (4-bit lanes: their unpacking, 3 instructions
  // per 16 vpdpbusd, measured no slower than the expanded panel's loads).
  if (vnni) {
    at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
      std::vector<uint8_t> buf(pb.bits == 6 ? K * 16 + 64 : 0);
      uint8_t* u8 = (uint8_t*)(((uintptr_t)buf.data() + 63) & ~(uintptr_t)63);
      for (int64_t mb = 0; mb < M; mb += kMC) {
        const int64_t me = std::min(M, mb + kMC);
        const bool expand = pb.bits == 6 && me - mb >= kVnniExpandRows;
        for (int64_t p = p0; p < p1; ++p) {
          const uint8_t* panel = pb.qw + p * K * pb.bits * 2;
          if (expand) expand_panel_u8<6>(panel, K, u8);
          for (int64_t m = mb, mr; m < me; m += mr) {
            mr = std::min<int64_t>(kMRVnni, me - m);
            panel_rows_avx512vnni(pb, expand ? u8 : panel, expand ? 8 : pb.bits, p, m, (int)mr);
          }
        }
      }
    });
    return n == P * 16 ? y : y.narrow(1, 0, n);
  }
#endif
  auto* fn = &panel_rows_scalar;
#if defined(__x86_64__)
  if (path == Path::kAvx2) fn = &panel_rows_avx2_any;
#endif
  // Rows in register blocks of kMR
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t mb = 0; mb < M; mb += kMC) {
      const int64_t me = std::min(M, mb + kMC);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = mb, mr; m < me; m += mr) {
          mr = std::min<int64_t>(kMR, me - m);
          fn(pb, p, m, (int)mr);
        }
    }
  });
  return n == P * 16 ? y : y.narrow(1, 0, n);
}

// q uint8 [N, K] (values < 2^bits) -> the panels of the file comment, uint8 [P, K * bits * 2]
// (padding columns 0); the same bytes as workers/kernels/gemm.py's PyTorch packing, in one pass.
at::Tensor gguf_pack_qweight(const at::Tensor& q, int64_t bits) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "gguf_pack_qweight: q must be uint8 [N, K]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "gguf_pack_qweight: bits must be 4, 6 or 8, got ", bits);
  const int64_t N = q.size(0), K = q.size(1), P = (N + 15) / 16;
  TORCH_CHECK(K % 8 == 0, "gguf_pack_qweight: K (", K, ") must be a multiple of 8");
  const at::Tensor qc = q.contiguous();
  const uint8_t* src = qc.data_ptr<uint8_t>();
  at::Tensor out = at::zeros({P, K * bits * 2}, q.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* pd = dst + p * K * bits * 2;
      for (int n = 0; n < 16 && 16 * p + n < N; ++n) {
        const uint8_t* row = src + (16 * p + n) * K;
        if (bits == 8) {
          for (int64_t k = 0; k < K; ++k) pd[(k / 4) * 64 + 4 * n + (k % 4)] = row[k];
          continue;
        }
        for (int64_t c = 0; c < K / 8; ++c) {
          uint8_t* ch = pd + c * chunk_bytes((int)bits);
          for (int j = 0; j < 4; ++j) {
            const uint8_t a = row[8 * c + j], b = row[8 * c + 4 + j];
            ch[4 * n + j] = (uint8_t)((a & 0x0F) | ((b & 0x0F) << 4));
            if (bits == 6) {
              const int i = 4 * n + j, l = i / 16, bb = i % 16;
              ch[64 + bb] |= (uint8_t)(((a >> 4) & 3) << (2 * l));
              ch[80 + bb] |= (uint8_t)(((b >> 4) & 3) << (2 * l));
            }
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

// The path gguf_linear takes at level `isa` (file comment): "amx", "avx512vnni", "avx2" or "scalar".
const char* gguf_path(kvmesh::Isa isa) { return kPathNames[static_cast<int>(path_at(isa))]; }

}  // namespace kvmesh_gemm

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("gguf_pack_qweight(Tensor q, int bits) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? superscales, int bits, int group_size, "
        "int N, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("gguf_linear", &kvmesh_gemm::gguf_linear_cpu);
  m.impl("gguf_pack_qweight", &kvmesh_gemm::gguf_pack_qweight);
}
