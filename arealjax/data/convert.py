"""Converts local JSONL / Parquet files to a tfds dataset (array_record) that `--config.data.path` can read.

  python -m arealjax.data.convert --out=/data/tfds --train=a.jsonl,b.jsonl --test=t.jsonl [--layout=gsm8k]
      [--on-error=skip]

Prints the converted dataset's directory (…/<layout>/1.0.0).
"""

import argparse
import contextlib
import logging
import sys

from arealjax.data.builders import LAYOUTS, RowError, convert


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="tfds data dir")
    for split in ("train", "test", "validation"):
        p.add_argument(f"--{split}", default="", help=f"comma-separated files of the {split} split")
    p.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS])
    p.add_argument("--on-error", default="raise", choices=["raise", "skip"])
    p.add_argument("--overwrite", action="store_true", help="replace a dataset converted from other files")
    args = p.parse_args(argv)
    files = {s: getattr(args, s).split(",") for s in ("train", "test", "validation") if getattr(args, s)}
    if not files:
        p.error("give at least one of --train, --test, --validation")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()  # stdout carries only the dataset's path
    try:
        with contextlib.redirect_stdout(sys.stderr):  # tfds prints its progress
            path = convert(files, args.out, layout=args.layout, on_error=args.on_error, overwrite=args.overwrite)
    except (RowError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
