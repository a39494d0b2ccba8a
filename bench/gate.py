"""The paired quality gate: is a configuration's key-fact accuracy worse than its reference's,
judged item by item on the same PolicyDesk items?

Every item (a single question or one chat turn) is scored right or wrong for both
configurations, which gives four counts: both right, both wrong, ``b`` = right for the
reference only (a loss), ``c`` = right for the configuration only (a gain). Only the
discordant pairs (``b``, ``c``) carry evidence about a difference.

- **McNemar's exact test** (McNemar 1947; the exact form is the two-sided binomial test of
  ``b`` against ``Bin(b + c, 1/2)``, see Fagerland, Lydersen & Laake 2013, "The McNemar test
  for binary matched-pairs data", BMC Med. Res. Methodol. 13:91): :func:`mcnemar_exact`.
- **Accuracy difference** ``(c - b) / n`` (configuration minus reference) with a 95% interval:
  the Agresti-Min adjusted Wald interval for matched proportions (Agresti & Min 2005, Stat.
  Med. 24:729-740: add 1/2 to each of the four cells): :func:`paired_difference_interval`.
- **Accuracy** of one configuration with a 95% Wilson score interval (Wilson 1927):
  :func:`wilson_interval`.

Verdict (:func:`verdict`), with ``max_drop_points`` = :data:`GATE_POINTS` (2):

- ``FAIL`` when the configuration is worse with p < 0.05 (``b > c``), or when its accuracy is
  more than 2 points below the reference's;
- ``PASS`` when neither, and the interval's lower end shows the drop is at most 2 points
  (non-inferiority: difference >= -2 points with 95% confidence);
- ``NO EVIDENCE`` otherwise: too few items or too many discordant pairs to tell. It is
  reported as such, never as a pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

GATE_POINTS = 2.0        # the most key-fact accuracy may drop vs the reference, in percentage points
ALPHA = 0.05             # significance level of the McNemar test
Z95 = 1.959963984540054  # two-sided 95% normal quantile

PASS, FAIL, NO_EVIDENCE = "PASS", "FAIL", "NO EVIDENCE"


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``successes / n``, as fractions in [0, 1].
    Raises ValueError for n < 1 or successes outside [0, n]."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)        # exact ends, not rounding residue
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Bin(n, 1/2), exact (integer arithmetic)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` and ``c`` discordant pairs:
    ``min(1, 2 * P(X <= min(b, c)))`` with ``X ~ Bin(b + c, 1/2)``; 1.0 when there are none.
    Raises ValueError for negative counts."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    return min(1.0, 2 * _binom_cdf(min(b, c), b + c))


def paired_difference_interval(n11: int, b: int, c: int, n00: int, z: float = Z95) -> tuple[float, float, float]:
    """Accuracy difference (configuration - reference) of paired items and its 95% Agresti-Min
    interval, as fractions: ``(difference, low, high)``. ``n11`` both right, ``b`` reference
    only, ``c`` configuration only, ``n00`` both wrong. The difference itself is the plain
    ``(c - b) / n``; the interval adds 1/2 to each cell. Raises ValueError without items."""
    n = n11 + b + c + n00
    if n < 1 or min(n11, b, c, n00) < 0:
        raise ValueError(f"need non-negative counts and at least one item, got {(n11, b, c, n00)}")
    diff = (c - b) / n
    bs, cs, ns = b + 0.5, c + 0.5, n + 2
    d = (cs - bs) / ns
    se = math.sqrt(max(0.0, (bs + cs) - (cs - bs) ** 2 / ns)) / ns
    return diff, max(-1.0, d - z * se), min(1.0, d + z * se)


def paired_counts(test: Sequence[bool], reference: Sequence[bool]) -> dict:
    """The four cells of paired correctness: ``both_right``, ``reference_only`` (b),
    ``test_only`` (c), ``both_wrong``. Raises ValueError for lists of different lengths."""
    if len(test) != len(reference):
        raise ValueError(f"need paired results, got {len(test)} and {len(reference)}")
    pairs = list(zip(reference, test))
    return {"both_right": sum(r and t for r, t in pairs), "reference_only": sum(r and not t for r, t in pairs),
            "test_only": sum(t and not r for r, t in pairs), "both_wrong": sum(not r and not t for r, t in pairs)}


def verdict(test: Sequence[bool], reference: Sequence[bool], max_drop_points: float = GATE_POINTS,
            alpha: float = ALPHA) -> dict:
    """The paired gate of per-item correctness ``test`` against ``reference`` (same items, same
    order). Returns the counts, ``n``, ``p_value`` (McNemar exact), ``difference_points`` and its
    95% interval ``difference_ci_points`` (configuration - reference, percentage points),
    ``drop_points`` (= -difference), ``verdict`` (:data:`PASS`, :data:`FAIL` or
    :data:`NO_EVIDENCE`) and ``reason`` (a sentence). Raises ValueError without items."""
    cells = paired_counts(test, reference)
    b, c = cells["reference_only"], cells["test_only"]
    n = len(test)
    diff, lo, hi = paired_difference_interval(cells["both_right"], b, c, cells["both_wrong"])
    p = mcnemar_exact(b, c)
    drop = round(-100.0 * diff, 6)                 # rounded so that 0.50 -> 0.48 is exactly 2.0
    if b > c and p < alpha:
        v, why = FAIL, f"worse: {b} items lost, {c} gained, McNemar p = {p:.3g} < {alpha:g}"
    elif drop > max_drop_points:
        v, why = FAIL, f"accuracy {drop:.1f} points below the reference (limit {max_drop_points:g})"
    elif 100.0 * lo >= -max_drop_points - 1e-9:
        v, why = PASS, (f"{b} lost, {c} gained; the 95% interval's low end {100 * lo:+.1f} points is within "
                        f"{max_drop_points:g} points")
    else:
        v, why = NO_EVIDENCE, (f"{b} lost, {c} gained (p = {p:.3g}); the 95% interval "
                               f"[{100 * lo:+.1f}, {100 * hi:+.1f}] points admits a drop of more than "
                               f"{max_drop_points:g}: too few items to tell")
    return {**cells, "n": n, "p_value": p, "difference_points": 100.0 * diff,
            "difference_ci_points": [100.0 * lo, 100.0 * hi], "drop_points": drop, "verdict": v, "reason": why}
