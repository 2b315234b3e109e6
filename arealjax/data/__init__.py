"""Datasets: local files → tfds array_record (builders.py, convert.py), streamed with grain (pipeline.py); the
default job's synthetic task (arithmetic.py)."""
