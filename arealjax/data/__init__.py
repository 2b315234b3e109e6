"""Datasets: local files → tfds array_record (builders.py, convert.py), streamed with grain (pipeline.py); the
synthetic tasks (arithmetic.py, the default job's; remainder.py, the long-tail one), by config name in TASKS."""

from arealjax.data import arithmetic, remainder

TASKS = {"addition": arithmetic, "remainder": remainder}  # config.task.name -> the synthetic task's module
