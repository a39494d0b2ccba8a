"""Weights on 2 MiB pages: one anonymous mapping advised ``MADV_HUGEPAGE`` (Linux transparent
huge pages) that the packed bf16 weights are copied into at load.

Why: batch-1 decode streams every weight once per step; on 4 KiB pages that is ~50,000 pages
(SmolLM2-135M, 270 MB) whose TLB misses and page-bounded hardware prefetch slow the read
(``python -m bench.huge_pages`` measures both layouts; figures: docs/engine.md, "Weights on
2 MiB pages").

Used only where the kernels read the weights (CPU: the native bf16 and GGUF GEMMs); a no-op
where the kernel's THP setting is ``never`` or ``mmap.MADV_HUGEPAGE`` is missing (not Linux).
There is no switch of its own (issue 38 decided against one: it won in every measurement but one
run in the noise, and the system's THP setting already turns it off).
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 4096            # each tensor starts on its own 4 KiB boundary inside the arena
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether :func:`to_huge_pages` would move anything: Linux with ``MADV_HUGEPAGE``, THP not
    ``[never]``."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def empty_on_huge_pages(specs: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor] | None:
    """Uninitialised CPU tensors of the given ``(shape, dtype)``, in order, inside one anonymous
    mapping advised for 2 MiB pages (each on a 4 KiB boundary; no page is touched until
    written, so copying weights in one at a time and dropping each original keeps the load's
    peak near one copy). The mapping lives as long as any of the tensors (torch holds the
    buffer). None when :func:`available` is False or ``specs`` is empty.

    Raises:
        OSError: the mapping could not be made (out of address space or memory)."""
    if not specs or not available():
        return None
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + ALIGN - 1) // ALIGN * ALIGN
    arena = mmap.mmap(-1, (total + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE,
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)          # before the first touch: faults map 2 MiB pages
    raw = torch.frombuffer(arena, dtype=torch.uint8)
    log.debug("kvmesh: %d tensors (%.0f MB) on 2 MiB pages", len(specs), total / 1e6)
    return [raw[off:off + n].view(dtype).view(shape) for off, n, (shape, dtype) in zip(offsets, sizes, specs)]


def to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU tensors) on 2 MiB pages (:func:`empty_on_huge_pages`), or
    ``tensors`` unchanged where that gives None or a tensor is not on the CPU."""
    if any(t.device.type != "cpu" for t in tensors):
        return tensors
    views = empty_on_huge_pages([(t.shape, t.dtype) for t in tensors])
    if views is None:
        return tensors
    return [v.copy_(t) for v, t in zip(views, tensors)]
