"""Whole micro-dollars out of exact shares: the one largest-remainder rule every split of money uses. Pure."""

from __future__ import annotations

from fractions import Fraction
from math import lcm
from numbers import Rational
from typing import Sequence, Union

Weight = Union[Rational, float]


def _ratio(weight: Weight) -> tuple[int, int]:
    """``weight`` as an exact (numerator, denominator > 0): a float is taken at its exact binary value, as
    ``Fraction(weight)`` takes it."""
    if isinstance(weight, float):
        return weight.as_integer_ratio()
    if isinstance(weight, Rational):
        return weight.numerator, weight.denominator
    exact = Fraction(weight)
    return exact.numerator, exact.denominator


def apportion(total: int, weights: Sequence[Weight]) -> tuple[int, ...]:
    """Split the integer ``total`` over ``weights`` by largest remainder (Hamilton's method).

    ``weights``: exact rationals (``int``, ``Fraction``) or floats, each taken at its exact value. Returns
    non-negative integers that add up to ``total``; each is the floor or the ceiling of
    ``total × weight / sum(weights)``; ties in the remainder go to the lower index (callers sort by their
    tie-break key). All-zero weights are allowed only for a zero total.
    """
    if total < 0:
        raise ValueError(f"cannot apportion a negative total {total}")
    ratios = [_ratio(w) for w in weights]
    if any(n < 0 for n, _ in ratios):
        raise ValueError("weights must be >= 0")
    # Exact in integers: over a common denominator each weight is an integer, and total × w / sum(w) is the
    # integer quotient and remainder of total × W by sum(W) (the same floors and the same remainder order as
    # the rationals themselves, at a fraction of Fraction's cost).
    common = lcm(*(d for _, d in ratios)) if ratios else 1
    scaled = [n * (common // d) for n, d in ratios]
    weight_sum = sum(scaled)
    if weight_sum == 0:
        if total:
            raise ValueError(f"cannot apportion {total} over zero weights")
        return (0,) * len(weights)
    shares = []
    remainders = []
    for w in scaled:
        share, remainder = divmod(total * w, weight_sum)
        shares.append(share)
        remainders.append(remainder)
    left = total - sum(shares)
    if left:
        ranking = sorted(range(len(shares)), key=lambda i: (-remainders[i], i))
        for index in ranking[:left]:
            shares[index] += 1
    return tuple(shares)
