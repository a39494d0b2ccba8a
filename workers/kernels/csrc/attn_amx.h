// The AMX-BF16 tile multiply of the flash-attention path (attn_flash.h): `AmxMul` computes the
// products of `DpMul` with TDPBF16PS on tiles. Included by attn_kernel.h inside the ISA
// namespace when KVMESH_ISA >= 4 (attn_amx.cpp), after attn_flash.h.
//
// Reference: Intel 64 and IA-32 Architectures Software Developer's Manual vol. 1 ch. 3.4 (AMX),
// vol. 2 (TDPBF16PS, LDTILECFG). The thread's tile configuration is loaded per item (begin) and
// released after its items (run_items), so ATen's and the GEMM's own tile users configure again.
// Tile registers: tmm0-3 accumulators, tmm4 A, tmm5-7 B.

struct alignas(64) AmxTileCfg {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
// A static object: GCC does not see LDTILECFG read a stack copy's stores (see micro_amx.cpp).
static const AmxTileCfg kAttnTiles = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

static inline void amx_release_tiles() { _tile_release(); }

// out[16, 64] (row stride 64 floats): N column tiles of 16 of A x B over nk steps of 32 along
// k, where step k reads the A tile at A + 32 k (16 rows, lda bytes apart) and the N B tiles
// (16 x 64 bytes each, packed) at B + k * bk + 512 n. Q K^T: A = Q rows, B = packed K; P V:
// A = P, B = packed V.
template <int N>
static inline void tiles_mul(const uint16_t* A, int lda, int nk, const uint16_t* B, int64_t bk, float* out) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
  for (int k = 0; k < nk; ++k) {
    _tile_loadd(4, A + k * 32, lda);
    const uint16_t* b = B + k * bk;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (N > 1) { _tile_loadd(6, b + 512, 64); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (N > 2) { _tile_loadd(7, b + 1024, 64); _tile_dpbf16ps(2, 4, 7); }
    if constexpr (N > 3) { _tile_loadd(5, b + 1536, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, out, 256);
  if constexpr (N > 1) _tile_stored(1, out + 16, 256);
  if constexpr (N > 2) _tile_stored(2, out + 32, 256);
  if constexpr (N > 3) _tile_stored(3, out + 48, 256);
}

struct AmxMul {
  static inline void begin() { _tile_loadconfig(&kAttnTiles); }
  template <int N>
  static inline void mul(const uint16_t* A, int lda, int nk, const uint16_t* B, int64_t bk, float* out, int) {
    tiles_mul<N>(A, lda, nk, B, bk, out);      // a tile holds 16 rows: padding rows cost nothing more
  }
};
