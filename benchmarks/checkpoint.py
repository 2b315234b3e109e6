"""Checkpoint and data-pipeline figures, side by side in one run.

  python benchmarks/checkpoint.py            # --params 50 (millions) --rows 20000
  python benchmarks/checkpoint.py --smoke    # 1M params, 200 rows (seconds): checks that the script runs

1. Save (the blocking part the trainer waits for, then the whole async write) and restore of params + Adam
   state, on local disk and on a gs:// bucket served by the local GCS emulator (tests/gcs_emulator.py).
2. Converting a GSM8K-layout JSONL file to array_record, and streaming prompts (shuffle + chat template +
   tokenise) through grain.
Printed to stdout as two tables; checkpoints and converted data go to a temporary directory and the emulator's
memory, removed at exit.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def emulator() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/gcs_emulator.py"), "start", "--host", "127.0.0.1",
                             "--port", str(port), "--default-bucket", "arealjax-bench", "--in-memory", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url)
    return proc, "gs://arealjax-bench"


def checkpoint_row(where: str, directory: str, n_params: int) -> str:
    import jax
    import jax.numpy as jnp

    from arealjax.checkpoint import Checkpointer

    shapes = [(n_params // 8 // 1024, 1024)] * 8
    keys = jax.random.split(jax.random.key(0), len(shapes))
    params = {f"w{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes))}
    state = SimpleNamespace(params=params, opt_state={"mu": jax.tree.map(jnp.zeros_like, params),
                                                      "nu": jax.tree.map(jnp.ones_like, params)}, version=0)
    meta = {"version": 1, "optimizer_steps": 1, "skipped_steps": 0}
    ckpt = Checkpointer(directory, every_steps=1)
    ckpt.maybe_save(1, state, meta)  # warm-up (compiles nothing, but opens handlers and connections)
    ckpt.manager.wait_until_finished()
    t0 = time.perf_counter()
    ckpt.maybe_save(2, state, meta)
    blocking = time.perf_counter() - t0
    ckpt.manager.wait_until_finished()
    total = time.perf_counter() - t0
    ckpt.close()
    target = SimpleNamespace(params=jax.tree.map(jnp.zeros_like, params),
                             opt_state=jax.tree.map(jnp.zeros_like, state.opt_state), version=0)
    reader = Checkpointer(directory)
    t0 = time.perf_counter()
    reader.restore_latest(target)
    jax.block_until_ready(target.params)
    restore = time.perf_counter() - t0
    reader.close()
    gb = 3 * n_params * 4 / 1e9
    return (f"| {where} | {n_params / 1e6:.0f}M params + Adam ({gb:.2f} GB) | {blocking:.2f} s | {total:.2f} s "
            f"({gb / total:.2f} GB/s) | {restore:.2f} s ({gb / restore:.2f} GB/s) |")


def data_rows(rows: int, tmp: Path) -> list[str]:
    from arealjax.data.builders import convert
    from arealjax.data.pipeline import PromptStream
    from arealjax.tokenizer import CharTokenizer

    src = tmp / "gsm8k.jsonl"
    src.write_text("".join(json.dumps({"question": f"tom has {i} apples and buys {i % 7} more. how many now?",
                                       "answer": f"{i} + {i % 7} = {i + i % 7}\n#### {i + i % 7}"}) + "\n"
                           for i in range(rows)))
    t0 = time.perf_counter()
    out = convert({"train": [src]}, tmp / "tfds")
    conv = time.perf_counter() - t0
    tok = CharTokenizer("0123456789+-*=?.,:;# abcdefghijklmnopqrstuvwxyz\n")
    stream = PromptStream(out, "train", tok, seed=0, epochs=1, max_prompt_tokens=128)
    t0 = time.perf_counter()
    n = sum(1 for _ in stream)
    rate = n / (time.perf_counter() - t0)
    return [f"| convert {rows:,} GSM8K rows (JSONL → array_record) | {conv:.2f} s ({rows / conv:,.0f} rows/s) |",
            f"| stream prompts (grain shuffle + chat template + tokenise) | {rate:,.0f} prompts/s |"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=50, help="millions")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--smoke", action="store_true", help="--params 1 --rows 200")
    args = p.parse_args()
    if args.smoke:
        args.params, args.rows = 1, 200
    proc, bucket = emulator()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print("| where | state | save: blocking | save: total | restore |\n|---|---|---|---|---|")
            print(checkpoint_row("local disk", f"{tmp}/ckpt", args.params * 1_000_000), flush=True)
            print(checkpoint_row("gs:// (local emulator)", f"{bucket}/ckpt", args.params * 1_000_000), flush=True)
            print("\n| data | figure |\n|---|---|")
            print("\n".join(data_rows(args.rows, Path(tmp))))
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
