"""Whole micro-dollars out of exact shares: the one largest-remainder rule every split of money uses. Pure."""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence


def apportion(total: int, weights: Sequence[Fraction]) -> tuple[int, ...]:
    """Split the integer ``total`` over ``weights`` by largest remainder (Hamilton's method).

    Returns non-negative integers that add up to ``total``; each is the floor or the ceiling of
    ``total × weight / sum(weights)``; ties in the remainder go to the lower index (callers sort by their
    tie-break key). All-zero weights are allowed only for a zero total.
    """
    if total < 0:
        raise ValueError(f"cannot apportion a negative total {total}")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be >= 0")
    weight_sum = sum(weights, Fraction(0))
    if weight_sum == 0:
        if total:
            raise ValueError(f"cannot apportion {total} over zero weights")
        return (0,) * len(weights)
    quotas = [total * w / weight_sum for w in weights]
    shares = [q.numerator // q.denominator for q in quotas]
    left = total - sum(shares)
    ranking = sorted(range(len(quotas)), key=lambda i: (shares[i] - quotas[i], i))
    for index in ranking[:left]:
        shares[index] += 1
    return tuple(shares)
