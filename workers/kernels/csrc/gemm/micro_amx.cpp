// AMX-BF16 block kernels of the bf16-weight GEMM (Intel Sapphire Rapids and later).
//
// The packed weight layout of micro.h is the layout TDPBF16PS expects for its B operand: one
// panel's 16 consecutive k-pair rows (16 x 64 bytes, contiguous) are one B tile, holding
// B[t][2c + j] = W[16p + c][2t + j]. An A tile is 16 rows x 32 bf16 of the activations (row
// stride ldx), a C tile 16 x 16 fp32. A call computes a block of MB * 16 rows x NP panels with
// MB * NP C tiles kept in tile registers for the whole k loop (2 x 2: tmm0-3 accumulate, tmm4-5
// hold A, tmm6-7 hold B), so each B tile loaded from memory feeds MB multiplies and each A
// tile NP. Requirements: kp (k-pairs) is a multiple of 16 (pack_bf16_weight pads K to 32), x
// has MB * 16 readable rows (the caller pads x to a multiple of 16 rows).
//
// Tile configuration: amx_configure() loads palette 1 with eight 16 x 64-byte tiles on the
// calling thread; amx_release() returns the tile state to its initial state (TILERELEASE).
// The caller configures before and releases after every parallel region (oneDNN and ATen
// configure their own tiles per call; see gemm_ops.cpp for ATen's cached context).
//
// Per-function target attributes, no torch headers (see micro_avx2.cpp). Reference: Intel 64
// and IA-32 Architectures Software Developer's Manual, vol. 1 ch. 3.4 (AMX) and vol. 2 (TDPBF16PS).
#if defined(__x86_64__)
#include <immintrin.h>

#include "micro.h"

namespace kvmesh_gemm {
namespace {

#define KV_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

template <int MB, int NP>
KV_AMX void amx_block(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w,
                      int64_t pstride, int64_t kp, float* __restrict tile) {
  const int64_t xs = ldx * 2;                 // bytes per activation row
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (MB > 1) _tile_zero(2);
  if constexpr (MB > 1 && NP > 1) _tile_zero(3);
  for (int64_t t = 0; t < kp; t += 16) {
    _tile_loadd(6, w + t * 2 * kPanel, 64);
    if constexpr (NP > 1) _tile_loadd(7, w + pstride + t * 2 * kPanel, 64);
    _tile_loadd(4, x + 2 * t, xs);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1) {
      _tile_loadd(5, x + 16 * ldx + 2 * t, xs);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t ts = NP * kPanel * 4;         // bytes per tile-buffer row
  _tile_stored(0, tile, ts);
  if constexpr (NP > 1) _tile_stored(1, tile + kPanel, ts);
  if constexpr (MB > 1) _tile_stored(2, tile + 16 * NP * kPanel, ts);
  if constexpr (MB > 1 && NP > 1) _tile_stored(3, tile + 16 * NP * kPanel + kPanel, ts);
}

}  // namespace

// A static object: GCC 12 drops stores into a stack copy before ldtilecfg (it does not see the
// instruction read them), leaving the tiles unconfigured (#UD at the first tile instruction).
const TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

KV_AMX void amx_configure() { _tile_loadconfig(&kTileConfig); }

KV_AMX void amx_release() { _tile_release(); }

const AmxTable& amx_table() {
  static const AmxTable t{{{nullptr, nullptr, nullptr},
                           {nullptr, &amx_block<1, 1>, &amx_block<1, 2>},
                           {nullptr, &amx_block<2, 1>, &amx_block<2, 2>}}};
  return t;
}

#undef KV_AMX

#define KV_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
KV_BF16 void store_tile_bf16(const float* tile, int ldt, int mr, int nc, const float* bias,
                             float* acc, int64_t lda, bool first, bool last, uint16_t* out,
                             int64_t ldo) {
  for (int i = 0; i < mr; ++i) {
    const float* t = tile + i * ldt;
    float* a = acc ? acc + i * lda : nullptr;
    uint16_t* o = out + i * ldo;
    for (int j = 0; j < nc; j += 16) {
      const __mmask16 m = nc - j >= 16 ? static_cast<__mmask16>(0xffff)
                                       : static_cast<__mmask16>((1u << (nc - j)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(m, t + j);
      if (a != nullptr && !first) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, a + j));
      else if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
      if (a != nullptr && !last) {
        _mm512_mask_storeu_ps(a + j, m, v);
        continue;
      }
      // round to nearest even, as c10::BFloat16(float) does for every non-NaN value
      const __m256i b16 = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
      _mm256_mask_storeu_epi16(o + j, m, b16);
    }
  }
}
#undef KV_BF16

}  // namespace kvmesh_gemm

#endif  // __x86_64__
