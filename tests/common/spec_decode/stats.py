"""Chi-square goodness of fit without scipy (Wilson-Hilferty quantile of the chi-square law)."""

from __future__ import annotations

import math
from collections import Counter

Z_999 = 3.0902  # the standard normal's 0.999 quantile


def chi_square(samples: list[int], probs: dict[int, float]) -> tuple[float, int]:
    """(statistic, degrees of freedom) of samples against probs; cells expected to hold fewer
    than 5 samples are pooled into one, and a sample outside probs' support counts in full."""
    n = len(samples)
    counts = Counter(samples)
    if any(t not in probs or probs[t] == 0.0 for t in counts):
        return math.inf, 1
    big = [t for t, p in probs.items() if p * n >= 5]
    cells = [(counts[t], probs[t] * n) for t in big]
    rest = [t for t in probs if t not in big]
    if rest:
        cells.append((sum(counts[t] for t in rest), sum(probs[t] for t in rest) * n))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return stat, max(1, len(cells) - 1)


def critical_value(df: int, z: float = Z_999) -> float:
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def fits(samples: list[int], probs: dict[int, float]) -> bool:
    """True unless the samples reject probs at the 0.001 level."""
    stat, df = chi_square(samples, probs)
    return stat <= critical_value(df)
