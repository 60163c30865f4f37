"""The pipeline layer: the plan (make_plan: the recipe's steps, keys, hits), the executors (local, ray) and the
workers that run steps (launch, fork server, standby), the budget of cores, memory and GPUs, the memory fit and
time estimates, step outcomes. It reaches plugins only through the registries of qbuild.contract.plugin."""
