"""Model sources: where the unquantized model comes from, and its identity."""
