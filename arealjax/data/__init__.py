"""Datasets: the synthetic task of the default job (and, with the data issue, tfds builders + grain)."""
