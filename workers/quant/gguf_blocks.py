"""GGUF block formats → one exact integer representation the ``gguf_linear`` kernel runs.

llama.cpp stores a weight ``W [N, K]`` row by row in blocks along K (ggml-common.h,
ggml-quants.c). Every format kvmesh serves decodes exactly to

    w[n, k] = s[n, g] * q[n, k] + z[n, g]          g = k // G

with ``q`` an unsigned integer and per-group float ``s``, ``z``, in one of two scale schemes:

- **flat**: ``s``, ``z`` float16 per group (the legacy formats, G = 32):
  Q4_0 ``d (q - 8)``, Q4_1 ``d q + m``, Q5_0 ``d (q - 16)``, Q5_1 ``d q + m``, Q8_0 ``d (q - 128)``
  (the int8 value stored as ``q + 128``); ``s`` and ``z`` are the block's own float16 numbers or
  a power-of-two multiple of them, so float16 holds them exactly (checked).
- **k-quant** (super-blocks of 256): ``s = d * sc``, ``z = -dmin * m`` with float32 ``d``,
  ``dmin`` per super-block (float16 in the file) and small integers ``sc``, ``m`` (int8) per
  group: Q4_K / Q5_K (G = 32, 6-bit ``sc`` and ``m``), Q6_K (G = 16, int8 ``sc``;
  ``d sc (q - 32)`` = ``s q + z`` with ``dmin = 32 d`` and ``m = sc``). ``d * sc`` needs up to
  19 significant bits, so it is formed in float32 by the kernel, never stored rounded.

``q`` takes 4-bit lanes (Q4_0, Q4_1, Q4_K: 0..15), 6-bit lanes (Q5_0, Q5_1, Q5_K, Q6_K: a
nibble plane and a 2-bit plane; Q5 values cost 6 bits instead of 5) or 8-bit lanes (Q8_0).
Tensors stacked into one Linear (q/k/v, gate/up) are brought to one representation by
:func:`stack` (widest lanes, smallest group; both exact) when they share a scheme.

Block layouts follow ggml-common.h; the decoding mirrors ``gguf.quants`` (the ``gguf`` package,
which the tests use as the independent reference).
"""

from __future__ import annotations

import dataclasses

import torch

QK_K = 256

#: GGML type name → (values per block, bytes per block)
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
         "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
#: the float types a GGUF may store a matrix in, served dense
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclasses.dataclass
class Unpacked:
    """One weight ``[N, K]`` in the kernel's integer representation (module docstring).

    Attributes:
        q: uint8 ``[N, K]``.
        bits: lane width, 4 (q < 16), 6 (q < 64) or 8.
        group: G, 16 or 32.
        scheme: ``"flat"`` or ``"k"``.
        a, b: flat: ``s``, ``z`` float32 ``[N, K // G]`` (float16-exact);
            k: ``sc``, ``m`` int8 ``[N, K // G]``.
        d, dmin: k only: float32 ``[N, K // 256]``.
    """

    q: torch.Tensor
    bits: int
    group: int
    scheme: str
    a: torch.Tensor
    b: torch.Tensor
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` (exact: every product and sum below is exact in float32 for the
        formats' value ranges)."""
        G = self.group
        if self.scheme == "flat":
            s, z = self.a, self.b
        else:
            per = QK_K // G
            d, dmin = self.d.repeat_interleave(per, dim=1), self.dmin.repeat_interleave(per, dim=1)
            s, z = d * self.a.float(), -(dmin * self.b.float())
        return self.q.float() * s.repeat_interleave(G, dim=1) + z.repeat_interleave(G, dim=1)

    def rows(self, idx: torch.Tensor) -> "Unpacked":
        """The rows ``idx`` (a permutation or selection along N)."""
        pick = (lambda t: None if t is None else t[idx])
        return Unpacked(self.q[idx], self.bits, self.group, self.scheme, self.a[idx], self.b[idx],
                        pick(self.d), pick(self.dmin))

    def cols(self, start: int, end: int) -> "Unpacked":
        """The columns ``[start, end)`` (a tensor-parallel rank's input range). Raises
        ValueError when a bound does not fall on a block boundary (a group; a k-quant's
        256-value super-block)."""
        block = QK_K if self.scheme == "k" else self.group
        if start % block or end % block:
            raise ValueError(f"columns [{start}, {end}) do not fall on the {block}-value blocks of this weight")
        g0, g1 = start // self.group, end // self.group
        cut = (lambda t: None if t is None else t[:, start // QK_K: end // QK_K])
        return Unpacked(self.q[:, start:end], self.bits, self.group, self.scheme, self.a[:, g0:g1], self.b[:, g0:g1],
                        cut(self.d), cut(self.dmin))

    def regroup(self, bits: int, group: int) -> "Unpacked":
        """The same weight with lanes of ``bits`` (>= ``self.bits``) and groups of ``group``
        (dividing ``self.group``): exact."""
        if bits < self.bits or self.group % group:
            raise ValueError(f"cannot narrow {self.bits}-bit lanes / group {self.group} to {bits} / {group}")
        rep = self.group // group
        a, b = (self.a, self.b) if rep == 1 else (self.a.repeat_interleave(rep, 1), self.b.repeat_interleave(rep, 1))
        return Unpacked(self.q, bits, group, self.scheme, a, b, self.d, self.dmin)


def to_q4_1(u: Unpacked, rows: int = 1 << 14) -> Unpacked:
    """``u`` requantized to 4-bit lanes in llama.cpp's Q4_1 scheme (ggml-quants.c
    ``quantize_row_q4_1_ref``): flat, groups of 32, ``w = d q + m`` with ``m`` the group's minimum
    and ``d = (max - min) / 15``, both rounded to float16 first (the kernel's exact ``s``, ``z``),
    ``q = round((w - m) / d)`` clamped to 0..15 (0 where ``d`` is 0). Lossy: fewer bytes per
    weight for a model whose outputs are checked by another (a speculative draft). A 4-bit
    ``u`` is returned as it is. ``rows``: rows converted at a time (bounds the float32 copy).
    Raises ValueError: K not a multiple of 32."""
    if u.bits == 4:
        return u
    n, k = u.shape
    if k % 32:
        raise ValueError(f"to_q4_1: K={k} is not a multiple of 32")
    q = torch.empty(n, k, dtype=torch.uint8)
    d = torch.empty(n, k // 32)
    m = torch.empty(n, k // 32)
    for r in range(0, n, rows):
        w = u.rows(torch.arange(r, min(n, r + rows))).dequantize().view(-1, k // 32, 32)
        lo = w.amin(-1)
        dr = ((w.amax(-1) - lo) / 15).half().float()
        mr = lo.half().float()
        inv = torch.where(dr > 0, 1 / dr, torch.zeros_like(dr))
        q[r: r + rows] = ((w - mr[..., None]) * inv[..., None]).round_().clamp_(0, 15).to(torch.uint8).view(-1, k)
        d[r: r + rows], m[r: r + rows] = dr, mr
    return Unpacked(q, 4, 32, "flat", d, m)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] → float32 [...] (little-endian float16)."""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] → [..., 32]: low nibbles are values 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5_*)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K / Q5_K super-block → 6-bit (sc, m), each [..., 8]
    (ggml-quants.c get_scale_min_k4)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _flat(q, bits, d, z) -> Unpacked:
    for name, t in (("scale", d), ("offset", z)):
        if not torch.equal(t.half().float(), t):
            raise ValueError(f"a block {name} is not exactly representable in float16")
    return Unpacked(q, bits, 32, "flat", d, z)


def unpack(ggml_type: str, raw: torch.Tensor, k: int) -> Unpacked:
    """Decode the rows of one GGUF tensor: in one native pass over the bytes where the kernels
    are built (``kvmesh::gguf_unpack``, :func:`workers.kernels.gemm.gguf_unpack`), else with
    :func:`unpack_torch` (the reference; the same numbers).

    Args:
        ggml_type: a key of :data:`BLOCK`.
        raw: uint8 ``[N, K / block_values * block_bytes]`` (the file's bytes, row-major).
        k: K (values per row), a multiple of the block size.
    Raises:
        ValueError: unknown type, a K or byte count that does not fit the format, or a flat scale
            float16 cannot hold.
    """
    _check(ggml_type, raw, k)
    from workers.kernels import gemm
    if raw.device.type != "cpu" or not gemm.gguf_available():
        return unpack_torch(ggml_type, raw, k)
    q, a, b, d, dmin = gemm.gguf_unpack(raw, ggml_type, k)
    if d is None:
        return _flat(q, 8 if ggml_type == "Q8_0" else 4 if ggml_type in ("Q4_0", "Q4_1") else 6, a, b)
    return Unpacked(q, 4 if ggml_type == "Q4_K" else 6, 16 if ggml_type == "Q6_K" else 32, "k", a, b, d, dmin)


def _check(ggml_type: str, raw: torch.Tensor, k: int) -> None:
    if ggml_type not in BLOCK:
        raise ValueError(f"GGUF type {ggml_type} is not supported (kvmesh serves {', '.join(BLOCK)})")
    bv, bb = BLOCK[ggml_type]
    if k % bv or raw.shape[-1] != k // bv * bb:
        raise ValueError(f"{ggml_type}: a row of {k} values needs {k // bv * bb} bytes, got {raw.shape[-1]}")


def unpack_torch(ggml_type: str, raw: torch.Tensor, k: int) -> Unpacked:
    """:func:`unpack` in PyTorch ops (any device): the reference the native decode is tested
    against. Same arguments and errors."""
    _check(ggml_type, raw, k)
    bv, bb = BLOCK[ggml_type]
    n = raw.shape[0]
    blk = raw.reshape(n, k // bv, bb)
    if ggml_type == "Q8_0":
        d = _f16(blk[..., 0:2])
        q = (blk[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return _flat(q.reshape(n, k), 8, d, -128 * d)
    if ggml_type in ("Q4_0", "Q4_1"):
        d = _f16(blk[..., 0:2])
        off = 2 if ggml_type == "Q4_0" else 4
        q = _nibbles(blk[..., off:off + 16]).reshape(n, k)
        return _flat(q, 4, d, -8 * d if ggml_type == "Q4_0" else _f16(blk[..., 2:4]))
    if ggml_type in ("Q5_0", "Q5_1"):
        d = _f16(blk[..., 0:2])
        off = 2 if ggml_type == "Q5_0" else 4
        qh = blk[..., off:off + 4].contiguous().view(torch.int32)              # [n, nb, 1]
        hi = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)  # [n, nb, 32]
        q = (_nibbles(blk[..., off + 4:off + 20]) | (hi << 4)).reshape(n, k)
        return _flat(q, 6, d, -16 * d if ggml_type == "Q5_0" else _f16(blk[..., 2:4]))
    if ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, m = _k_scales(blk[..., 4:16])
        qs = blk[..., -128:].reshape(n, k // bv, 4, 1, 32)
        lo = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F            # [n, nb, 4, 2, 32]
        q = lo.reshape(n, k // bv, 256)
        bits = 4
        if ggml_type == "Q5_K":
            qh = blk[..., 16:48].reshape(n, k // bv, 1, 32)
            hi = (qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1               # [n, nb, 8, 32]
            q, bits = q | (hi.reshape(n, k // bv, 256) << 4), 6
        return Unpacked(q.reshape(n, k), bits, 32, "k", sc.reshape(n, -1).to(torch.int8),
                        m.reshape(n, -1).to(torch.int8), d, dmin)
    # Q6_K: ql [0:128], qh [128:192], scales int8 [192:208], d [208:210]
    ql = blk[..., 0:128].reshape(n, k // bv, 2, 1, 64)
    lo = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F                # [n, nb, 2, 2, 64]
    qh = blk[..., 128:192].reshape(n, k // bv, 2, 1, 32)
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 0x03          # [n, nb, 2, 4, 32]
    q = lo.reshape(n, k // bv, 256) | (hi.reshape(n, k // bv, 256) << 4)
    sc = blk[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = _f16(blk[..., 208:210])
    return Unpacked(q.reshape(n, k), 6, 16, "k", sc, sc.clone(), d, 32 * d)


def stack(parts: list[Unpacked]) -> Unpacked:
    """Rows of several weights with the same K, one under the other, in one representation:
    the widest lanes and the smallest group of the parts (exact). Raises ValueError when the
    parts use different scale schemes (no exact common form) or different K."""
    if len({p.scheme for p in parts}) != 1:
        raise ValueError(f"cannot stack GGUF weights of schemes {sorted({p.scheme for p in parts})}")
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot stack weights of K {[p.shape[1] for p in parts]}")
    bits, group = max(p.bits for p in parts), min(p.group for p in parts)
    parts = [p.regroup(bits, group) for p in parts]
    if len(parts) == 1:
        return parts[0]
    cat = (lambda f: None if f(parts[0]) is None else torch.cat([f(p) for p in parts]))
    return Unpacked(cat(lambda p: p.q), bits, group, parts[0].scheme, cat(lambda p: p.a), cat(lambda p: p.b),
                    cat(lambda p: p.d), cat(lambda p: p.dmin))


def dequantize_rows(ggml_type: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``[R, K]`` of raw GGUF rows (``[R, row bytes]`` uint8) of a block format or a
    float type (:data:`FLOAT_TYPES`): the embedding lookup's path."""
    if ggml_type in FLOAT_TYPES:
        return raw.contiguous().view(FLOAT_TYPES[ggml_type]).reshape(raw.shape[0], k).float()
    return unpack(ggml_type, raw, k).dequantize()
