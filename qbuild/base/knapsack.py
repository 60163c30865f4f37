"""A multiple-choice knapsack, solved exactly by dynamic programming: one option per group, each a (cost, value)
pair, the least summed value under a cost capacity (`allocate`) or the least summed cost under a value budget
(`smallest_within`). The mixed-precision searches (GGUF's per-tensor types, compressed-tensors' per-module schemes)
allocate with it: cost a tensor group's bytes, value its measured KLD increment. numpy is imported only when called.
"""

from __future__ import annotations


def allocate(options: list[list[tuple[int, float]]], capacity: int, unit: int = 1) -> list[int] | None:
    """Pick one option per group, minimizing the summed value (ΔKLD) with summed cost (Δbytes) ≤ capacity.

    options[g] = [(cost, value), ...]; costs may be negative (an option smaller than the base). Costs are counted in
    `unit`-byte steps rounded up, so a returned choice never exceeds the capacity. Returns each group's option
    index, or None when no choice fits."""
    import numpy as np

    room = capacity - sum(min(c for c, _ in opts) for opts in options)
    if room < 0:
        return None
    best, picks = _table(options, room // unit, unit)
    return _backtrack(options, picks, room // unit, unit) if np.isfinite(best[-1]) else None


def smallest_within(options: list[list[tuple[int, float]]], max_value: float, unit: int = 1) -> list[int] | None:
    """The choice of least summed cost whose summed value is ≤ max_value (min_size under a KLD budget), from the same
    table: its least capacity whose optimum is within the value budget. None when no choice is."""
    import numpy as np

    width = sum(-(-(max(c for c, _ in o) - min(c for c, _ in o)) // unit) for o in options)
    best, picks = _table(options, width, unit)
    within = np.nonzero(best <= max_value)[0]
    return _backtrack(options, picks, int(within[0]), unit) if len(within) else None


def _units(cost: int, low: int, unit: int) -> int:
    return -(-(cost - low) // unit)   # ceil: a choice's real size never exceeds what the table counts


def _table(options, width: int, unit: int):
    """best[j]: least summed value using at most j units over all groups; picks[g][j]: group g's option there."""
    import numpy as np

    inf = float("inf")
    best = np.zeros(width + 1)        # no group yet: nothing spent, nothing added
    picks = []
    for opts in options:
        low = min(c for c, _ in opts)
        new = np.full(width + 1, inf)
        pick = np.full(width + 1, -1, dtype=np.int64)
        for i, (cost, value) in enumerate(opts):
            w = _units(cost, low, unit)
            if w > width:
                continue
            cand = np.full(width + 1, inf)
            cand[w:] = best[: width + 1 - w] + value
            better = cand < new
            new[better], pick[better] = cand[better], i
        best = new
        picks.append(pick)
    return best, picks


def _backtrack(options, picks, j: int, unit: int) -> list[int]:
    choice = []
    for g in range(len(options) - 1, -1, -1):
        i = int(picks[g][j])
        choice.append(i)
        j -= _units(options[g][i][0], min(c for c, _ in options[g]), unit)
    return choice[::-1]
