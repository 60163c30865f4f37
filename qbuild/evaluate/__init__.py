"""Evaluation: perplexity under a recorded protocol, through the runtime each format is served by."""
