// Micro-kernel interface of the kvmesh bf16-weight GEMM (no torch headers here: the ISA
// files that implement it are compiled with per-function target attributes and must not pull
// in inline torch code, see micro_avx2.cpp).
//
// Packed weight layout ("VNNI-2", as oneDNN/SGLang use for bf16): for a weight W [N, K]
// (PyTorch Linear layout), N is padded to Np = 16 * ceil(N / 16) and K to Kp = 32 * ceil(K / 32)
// with zeros (a multiple of 32 so that 16 k-pair rows make one AMX B tile, micro_amx.cpp), and the bf16 bits are stored as uint16 [Np / 16][Kp / 2][16][2]:
//   packed[p][t][c][j] = bf16(W[16 p + c][2 t + j]).
// One "panel" p is 16 output columns; one k-pair row of a panel (t) is 64 bytes, i.e. exactly
// one cache line, holding (W[n][2t], W[n][2t+1]) for its 16 columns. A 32-bit lane holds one
// pair: `lane << 16` is W[n][2t] as fp32 and `lane & 0xffff0000` is W[n][2t+1] (bf16 is the
// high half of fp32), so widening costs one integer op per 8 (AVX2) or 16 (AVX-512) weights,
// and AVX512-BF16's vdpbf16ps consumes the pairs as they are.
#pragma once
#include <cstdint>

namespace kvmesh_gemm {

constexpr int kPanel = 16;      // output columns per panel
constexpr int kGroup = 2;       // panels per micro-kernel call (32 columns)
constexpr int kMaxMR = 8;       // largest row block of any ISA

// tile[m * ldt + c] = sum_{t < kp} sum_{j < 2} x[m * ldx + 2 t + j] * W_p[t][c % 16][j]
// for m < MR and c < 16 * NP, where W_p = w + (c / 16) * pstride (uint16 elements) is the
// panel at the current k-pair offset. ldt = 16 * NP. x: fp32, 2 * kp readable per row.
// The tile is overwritten (not accumulated).
using MicroFn = void (*)(const float* x, int64_t ldx, const uint16_t* w, int64_t pstride,
                         int64_t kp, float* tile);

// Same for bf16 activations on AVX512-BF16 (vdpbf16ps): x holds bf16 bits, 2 * kp per row.
using MicroBf16Fn = void (*)(const uint16_t* x, int64_t ldx, const uint16_t* w,
                             int64_t pstride, int64_t kp, float* tile);

struct MicroTable {
  const char* name;
  int mr_max;                              // largest MR with a kernel (<= kMaxMR)
  MicroFn fn[kMaxMR + 1][kGroup + 1];      // fn[MR][NP], MR in [1, mr_max], NP in {1, 2}
};

// Each returns its table; the caller must only use one whose ISA the CPU supports.
const MicroTable& scalar_table();
const MicroTable& avx2_table();
const MicroTable& avx512_table();
struct MicroBf16Table {
  int mr_max;
  MicroBf16Fn fn[kMaxMR + 1][kGroup + 1];
};
const MicroBf16Table& avx512bf16_table();

// How the ISA files build their tables: fill_table sets t.fn[m][np] = K::fn<m, np>() for m in
// [1, MR] and np in {1, 2} (T: MicroTable or MicroBf16Table); make_table returns a MicroTable
// named `name` with mr_max = MR, so filled.
template <class K, int MR, class T>
constexpr void fill_table(T& t) {
  t.fn[MR][1] = K::template fn<MR, 1>();
  t.fn[MR][2] = K::template fn<MR, 2>();
  if constexpr (MR > 1) fill_table<K, MR - 1>(t);
}
template <class K, int MR>
MicroTable make_table(const char* name) {
  MicroTable t{name, MR, {}};
  fill_table<K, MR>(t);
  return t;
}

// AMX-BF16 (micro_amx.cpp): fn[MB][NP] computes MB * 16 rows x NP panels of bf16 activations
// (tile row stride NP * 16 floats; rows past the caller's count are computed from whatever x
// holds there and must be readable). kp must be a multiple of 16. Only between
// amx_configure() and amx_release() on the same thread.
struct AmxTable {
  MicroBf16Fn fn[3][kGroup + 1];
};
const AmxTable& amx_table();
void amx_configure();
void amx_release();

// Bytes of x an AMX row chunk holds (L2-resident while the chunk's weights stream past it): the
// bf16 GEMM's and the GGUF kernel's AMX routes (docs/engine.md, kernel constants).
constexpr int64_t kAmxXBytes = 1 << 20;

// The AMX row blocks of rows [r0, r1) (r0 a multiple of 16): block(a, mb, first, rows) per
// call of an MB = mb block kernel on A rows at `a` (row stride ldx), computing rows [first,
// first + rows). x holds M rows; rows [M16, M) (M16 = M rounded down to 16) past the last whole
// 16-row tile come from xtail, their 16-row zero-padded copy (nullptr: x has readable rows up to
// a multiple of 16), so that no tile reads past x.
template <class Block>
inline void amx_row_blocks(const uint16_t* x, int64_t ldx, const uint16_t* xtail, int64_t M16, int64_t M,
                           int64_t r0, int64_t r1, Block&& block) {
  for (int64_t r = r0; r < r1; r += 32) {
    const int mb = r1 - r > 16 ? 2 : 1;
    if (xtail == nullptr || r + 16 * mb <= M16) {
      block(x + r * ldx, mb, r, static_cast<int>(r1 - r < 16 * mb ? r1 - r : 16 * mb));
      continue;
    }
    if (r < M16) block(x + r * ldx, 1, r, 16);          // a whole first tile, then the partial one
    block(xtail, 1, M16, static_cast<int>(M - M16));
  }
}

// AVX512-BF16 epilogue (micro_amx.cpp) of a bf16-output tile of mr rows x nc columns (row
// stride ldt floats): v = tile + (first ? bias : acc); with acc (fp32 partial sums, row stride
// lda) and not last, acc = v; else out = bf16(v), rounded to nearest even (row stride ldo).
// bias and acc may be null.
void store_tile_bf16(const float* tile, int ldt, int mr, int nc, const float* bias, float* acc,
                     int64_t lda, bool first, bool last, uint16_t* out, int64_t ldo);

}  // namespace kvmesh_gemm
