"""Calibration: activation statistics of every Linear's input, and the per-input-channel
scales derived from them.

- :func:`collect_stats` runs the dense (float32) model over calibration text (the PolicyDesk
  policies by default, or ``calibration_data``), with forward pre-hooks on the Linears. Per
  layer: ``absmax [K]`` and ``absmean [K]`` of its input over all calibration tokens, and
  ``rows [R, K]``, a deterministic subsample of input rows (``ROWS`` per layer).
- :func:`awq_scale` (int4): AWQ's scale search (Lin et al. 2024, "AWQ: Activation-aware Weight
  Quantization", arXiv:2306.00978, §3.2): ``s = absmean^α / sqrt(max·min)``, α on a grid of
  ``AWQ_GRID`` points in [0, 1]; keeps the α whose quantized ``W·diag(s)`` (then ``/s``)
  gives the smallest output MSE on ``rows``. α = 0 is round-to-nearest, so the search never
  does worse than RTN on the calibration rows. Not done: AWQ's weight clipping search, and
  re-running the model between layers (all statistics come from one dense pass).
- :func:`smoothquant_scale` (w8a8-int8): SmoothQuant (Xiao et al. 2023, arXiv:2211.10438, §4):
  ``s_j = max|X_j|^α / max|W_j|^(1-α)``, α = 0.5.

Either way the layer stores ``W·diag(s)`` and its input is divided by ``s`` (folded into the
preceding RMSNorm weight for qkv_proj / gate_up_proj, an explicit input scale otherwise); see
:mod:`workers.quant.store`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from workers.layers.attention import AttentionMetadata, PrefillChunk
from workers.layers.linear import Linear

CHUNK_TOKENS = 512        # tokens per calibration sequence
MAX_CHUNKS = 4            # at most 4 x 512 = 2048 calibration tokens
ROWS = 128                # input rows kept per Linear for the AWQ search
AWQ_GRID = 20             # α points in [0, 1]
SMOOTHQUANT_ALPHA = 0.5


@dataclass
class CalibrationText:
    """Calibration texts (one per document), their source (``policydesk`` or the file path)
    and the SHA-256 of their content (hex)."""

    docs: list[str]
    source: str
    sha256: str


def calibration_text(path: str = "") -> CalibrationText:
    """``path`` = a UTF-8 text file, or ``""`` = the PolicyDesk policies (:func:`policydesk.policy_texts`,
    one document per policy). Raises EngineError naming ``calibration_data`` when unreadable."""
    from kvmesh.core.errors import EngineError
    if path:
        p = Path(path).expanduser()
        try:
            docs = [p.read_text(encoding="utf-8")]
        except (OSError, UnicodeDecodeError) as e:
            raise EngineError(f"calibration_data {path!r}: {e}") from None
        if not docs[0].strip():
            raise EngineError(f"calibration_data {path!r} is empty")
        source = str(p.resolve())
    else:
        import policydesk
        docs = policydesk.policy_texts()
        source = "policydesk"
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode())
        h.update(b"\0")
    return CalibrationText(docs, source, h.hexdigest())


def calibration_chunks(model_dir: str | Path, text: CalibrationText) -> list[list[int]]:
    """Token ids of the calibration sequences: each document's tokens cut into chunks of
    ``CHUNK_TOKENS`` (documents taken in turn, first chunks first), at most ``MAX_CHUNKS``.
    Raises EngineError naming ``calibration_data`` when no chunk has 16 tokens."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    per_doc = [tok.encode(d) for d in text.docs]
    per_doc = [[ids[i:i + CHUNK_TOKENS] for i in range(0, len(ids), CHUNK_TOKENS)] for ids in per_doc]
    chunks = []
    for i in range(max(len(c) for c in per_doc)):
        chunks += [c[i] for c in per_doc if i < len(c) and len(c[i]) >= 16]
    if not chunks:
        from kvmesh.core.errors import EngineError
        raise EngineError(f"calibration_data {text.source!r}: fewer than 16 tokens of text")
    return chunks[:MAX_CHUNKS]


@dataclass
class InputStats:
    """Statistics of one Linear's input over the calibration tokens (float32)."""

    absmax: torch.Tensor      # [K]
    absmean: torch.Tensor     # [K]
    rows: torch.Tensor        # [R, K], R <= ROWS


@torch.inference_mode()
def collect_stats(model, chunks: list[list[int]], names: list[str] | None = None) -> dict[str, InputStats]:
    """Run the dense whole model (float32, CPU) over ``chunks`` and return the input statistics
    of its Linears (by module name, e.g. ``layers.3.mlp.down_proj``; ``names`` restricts them)."""
    from workers.kv_cache import allocate_kv_cache
    cfg = model.cfg
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and (names is None or n in names)}
    acc: dict[str, dict] = {n: {"max": None, "sum": None, "count": 0, "rows": []} for n in linears}
    gen = torch.Generator().manual_seed(0)
    per_chunk = -(-ROWS // max(len(chunks), 1))

    def hook(name):
        def pre(_mod, args):
            x = args[0].float()
            a = acc[name]
            ax = x.abs()
            m, s = ax.amax(dim=0), ax.sum(dim=0)
            a["max"] = m if a["max"] is None else torch.maximum(a["max"], m)
            a["sum"] = s if a["sum"] is None else a["sum"] + s
            a["count"] += x.shape[0]
            idx = torch.randperm(x.shape[0], generator=gen)[:per_chunk]
            a["rows"].append(x[idx].clone())
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    block = 16
    try:
        for ids in tqdm(chunks, desc="calibration", unit="chunk", leave=False):
            n = len(ids)
            nb = -(-n // block)
            caches = allocate_kv_cache(len(model.layers), nb, block, cfg.num_kv_heads, cfg.head_dim,
                                       torch.float32, torch.device("cpu"))
            md = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, 0, slice(0, nb))])
            hidden = model(torch.tensor(ids), torch.arange(n), md, caches)
            if model.is_last:
                model.compute_logits(hidden[-1:])     # lm_head's input too
    finally:
        for h in handles:
            h.remove()
    return {n: InputStats(a["max"], a["sum"] / a["count"], torch.cat(a["rows"])[:ROWS])
            for n, a in acc.items() if a["count"]}


def fake_quant_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantize-dequantize ``w [N, K]`` in int4 as :func:`workers.layers.quant.quantize_int4`
    does (K zero-padded to the group size; ``q * scale + min`` = ``(q - 8) * scale + zero``),
    without packing → [N, K] float32."""
    N, K = w.shape
    g = torch.nn.functional.pad(w, (0, (-K) % group_size)).reshape(N, -1, group_size)
    wmin, wmax = torch.aminmax(g, dim=-1, keepdim=True)
    scales = (wmax - wmin).clamp_(min=1e-6).div_(15.0)
    q = (g - wmin).div_(scales).round_().clamp_(0, 15)
    return q.mul_(scales).add_(wmin).reshape(N, -1)[:, :K]


def awq_scale(w: torch.Tensor, stats: InputStats, group_size: int) -> tuple[torch.Tensor, float]:
    """AWQ per-input-channel scale of a Linear. w: [N, K] float32. Returns (s [K] float32, α)."""
    x = stats.rows
    ref = x @ w.t()
    mean = stats.absmean.clamp(min=1e-8)
    best = (float("inf"), torch.ones_like(mean), 0.0)
    for alpha in torch.linspace(0, 1, AWQ_GRID).tolist():
        s = mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = fake_quant_int4(w * s, group_size) / s
        err = (x @ wq.t() - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def smoothquant_scale(w: torch.Tensor, stats: InputStats, alpha: float = SMOOTHQUANT_ALPHA) -> torch.Tensor:
    """SmoothQuant factors ``s [K]`` of a Linear (w: [N, K] float32): X/s and W·diag(s) are
    then about equally hard to quantize."""
    wmax = w.abs().amax(dim=0).clamp(min=1e-5)
    xmax = stats.absmax.clamp(min=1e-5)
    return (xmax.pow(alpha) / wmax.pow(1 - alpha)).clamp(min=1e-5)
