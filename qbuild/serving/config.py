"""A serving config as a step's worker sees it: the step's params["config"] (what the plan hashed) as attributes.

The plan validates a recipe's serving config (qbuild.planning.recipe.ServingConfig) and hashes its canonical form
into the serving, capacity and deploy steps' params; their runners (bench_step, capacity_step, deploy_step) start
servers from those params and hand the server plugins this view, which has the same fields and reads the same
(the plugins read attributes only: config.kv_cache_dtype, config.parallel, config.draft ...). It lives here, below
planning, so that the runners need nothing of the plan-time side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# left out of the canonical form while unset, so that serving steps planned before these levers existed keep their
# keys (qbuild.planning.recipe.ServingConfig.canonical, which the keys come from, leaves out the same)
UNSET_LEFT_OUT = ("threads", "batch_size", "ubatch_size", "draft", "draft_max", "draft_min")


@dataclass(frozen=True)
class ServedConfig:
    """The fields of qbuild.planning.recipe.ServingConfig, in its order (tests/test_serving_plan.py checks both)."""

    name: str
    kv_cache_dtype: str | None = None
    parallel: int | None = None
    prefix_caching: bool | None = None
    flash_attn: bool | None = None
    threads: int | None = None
    batch_size: int | None = None
    ubatch_size: int | None = None
    draft: str | None = None
    draft_max: int | None = None
    draft_min: int | None = None

    def canonical(self) -> dict:
        """As ServingConfig.canonical(): every field, those of UNSET_LEFT_OUT only when set."""
        return {k: v for k, v in asdict(self).items() if not (k in UNSET_LEFT_OUT and v is None)}
