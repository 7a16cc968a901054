"""Non-negative least squares on a few features, in pure Python (the time model's fit).

The systems are tiny (at most a handful of coefficients, tens to hundreds of samples), so the
normal equations solved by Gaussian elimination with partial pivoting are exact enough and need no
numpy. Coefficients of a time model are costs, so a negative one is noise: the active-set loop
pins the most negative coefficient at zero and solves again, at most once per feature.
"""

from __future__ import annotations

from collections.abc import Sequence


class SingularFit(ValueError):
    """The samples do not determine the coefficients (too few, or all alike)."""


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve a small square system in place by Gaussian elimination; raises SingularFit."""
    n = len(rhs)
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    if scale == 0.0:
        raise SingularFit("all features are zero")
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) <= 1e-12 * scale:
            raise SingularFit(f"feature {col} is not determined by the samples")
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for row in range(col + 1, n):
            factor = matrix[row][col] / matrix[col][col]
            if factor:
                for k in range(col, n):
                    matrix[row][k] -= factor * matrix[col][k]
                rhs[row] -= factor * rhs[col]
    out = [0.0] * n
    for row in range(n - 1, -1, -1):
        acc = rhs[row] - sum(matrix[row][k] * out[k] for k in range(row + 1, n))
        out[row] = acc / matrix[row][row]
    return out


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Plain least squares via the normal equations, each column scaled to unit size first."""
    width = len(rows[0])
    norms = [max(abs(r[j]) for r in rows) or 1.0 for j in range(width)]
    scaled = [[r[j] / norms[j] for j in range(width)] for r in rows]
    gram = [[sum(r[i] * r[j] for r in scaled) for j in range(width)] for i in range(width)]
    moment = [sum(r[i] * t for r, t in zip(scaled, targets, strict=True)) for i in range(width)]
    solved = _solve(gram, moment)
    return [solved[j] / norms[j] for j in range(width)]


def nonnegative_least_squares(
    rows: Sequence[Sequence[float]], targets: Sequence[float], *, relative: bool = True
) -> list[float]:
    """Coefficients c >= 0 minimising sum(((rows[i] . c) - targets[i]) / w_i)^2.

    With `relative` (the default) w_i = targets[i], so the fit minimises relative error: a
    10 ms sample counts as much as a 1 s one, which is what a latency predictor is judged by.
    Raises SingularFit when there are fewer samples than features or they determine nothing.
    """
    if not rows:
        raise SingularFit("no samples")
    width = len(rows[0])
    if any(len(r) != width for r in rows) or len(rows) != len(targets):
        raise ValueError("every row needs the same number of features and one target")
    if relative and any(t <= 0.0 for t in targets):
        raise ValueError("relative least squares needs positive targets")
    weights = [1.0 / t if relative else 1.0 for t in targets]
    weighted_rows = [[v * w for v in r] for r, w in zip(rows, weights, strict=True)]
    weighted_targets = [t * w for t, w in zip(targets, weights, strict=True)]
    active = list(range(width))  # features still free to be nonzero
    for _ in range(width):
        if len(rows) < len(active):
            raise SingularFit(f"{len(rows)} samples cannot determine {len(active)} coefficients")
        sub_rows = [[r[j] for j in active] for r in weighted_rows]
        solved = _least_squares(sub_rows, weighted_targets)
        most_negative = min(range(len(active)), key=lambda k: solved[k])
        if solved[most_negative] >= 0.0 or len(active) == 1:
            out = [0.0] * width
            for k, j in enumerate(active):
                out[j] = max(solved[k], 0.0)
            return out
        del active[most_negative]
    raise SingularFit("no non-negative fit")  # unreachable: the loop ends with one feature
