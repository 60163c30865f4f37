"""The planning layer: the recipe (its schema and loading) and the planner of each of its sections (model,
calibration, evaluation, lm-eval tasks, serving, the import's fidelity check), which turn recipe entries into
steps. It imports the services and below; plugins plan their own variants and targets above it."""
