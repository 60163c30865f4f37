"""Calibration and evaluation text: sources, the offline corpus, tokenization into shared artifacts."""
