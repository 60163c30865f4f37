"""Seeded 95 % bootstrap intervals of a measured figure, and how a figure is written with one ("value ±half-width").

A measurement repeated in independent runs (serving rounds, throughput repetitions) is resampled at two levels
(a hierarchical bootstrap, Saravanan et al. 2020): runs are drawn with replacement, then the samples within each
drawn run. Runs, not samples alone, are the independent units: the samples of one run share its machine state, so
resampling them alone would hide the run-to-run spread. Fewer than two runs give no interval (None). The same
samples and seed give the same interval.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where an interval is computed: a cached run writes figures with plus_minus and never loads it
LEVEL = 0.95
RESAMPLES = 1000


def percentile_interval(replicates, level: float = LEVEL) -> list[float] | None:
    """[lo, hi]: the central `level` of bootstrap replicates (rounded); None where a replicate has no value (NaN)."""
    import numpy as np

    arr = np.asarray(replicates, dtype=float)
    if not arr.size or np.isnan(arr).any():
        return None
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(arr, (tail, 100 - tail))
    return [round(float(lo), 4), round(float(hi), 4)]


def two_level_intervals(runs: list, statistics: dict[str, Callable[[np.ndarray], float]], seed: int,
                        resamples: int = RESAMPLES, level: float = LEVEL) -> dict[str, list[float] | None] | None:
    """name → [lo, hi] of each statistic (of all the drawn samples, pooled) over two-level resamples of `runs` (each
    run its samples: a sequence of numbers); None with fewer than two runs."""
    if len(runs) < 2:
        return None
    import numpy as np

    rng = np.random.default_rng(seed)
    arrays = [np.asarray(r, dtype=float) for r in runs]
    reps: dict[str, list[float]] = {name: [] for name in statistics}
    for _ in range(resamples):
        drawn = [arrays[k] for k in rng.integers(0, len(arrays), len(arrays))]
        pooled = np.concatenate([a[rng.integers(0, a.size, a.size)] for a in drawn])
        for name, statistic in statistics.items():
            reps[name].append(statistic(pooled) if pooled.size else np.nan)
    return {name: percentile_interval(values, level) for name, values in reps.items()}


def plus_minus(value: float | None, ci: list[float] | None, spec: str) -> str:
    """A figure (format spec `spec`, ".1f") with "±" half the width of its interval where it has one ("-" without a
    value)."""
    return "-" if value is None else format(value, spec) + half_width(ci, "{:" + spec + "}")


def half_width(ci: list[float] | None, template: str) -> str:
    """" ±h", half an interval's width written with `template` ("{:.1f}"), or "" without an interval."""
    return f" ±{template.format((ci[1] - ci[0]) / 2)}" if ci else ""
