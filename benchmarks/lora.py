"""LoRA vs full fine-tuning, measured side by side in one run on this machine.

  python benchmarks/lora.py                # the step/sync/generation table (a few minutes)
  python benchmarks/lora.py --accuracy     # also: the default job trained full and with LoRA (≈ 10 minutes)
  python benchmarks/lora.py --smoke        # the table at tiny sizes (seconds): the script itself works

1. Train step (decoupled PPO, AdamW) on one batch of default-job-shaped trajectories, the default model on the
   default trainer mesh: seconds per step (best of N), trainable params, optimizer state bytes.
2. Weight sync trainer mesh -> generator mesh: bytes moved and seconds, full params vs adapters (merged on the
   generator, or served on the fly).
3. Generation, the same adapted params merged vs applied on the fly: tokens/s for a batch of greedy requests.
4. (--accuracy) `main.py --config=configs/default.py` full and with LoRA from one shared SFT warm start: held-out
   accuracy every 10 RL steps and wall-clock.
The tables are printed to stdout; the --accuracy runs' directories go to a fresh temporary directory. --smoke shrinks
the default job's model, batch and generator (and, with --accuracy, runs main.py at benchmarks/cells.py `SMOKE`
sizes).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from arealjax import models  # noqa: E402
from arealjax.api import SamplingParams  # noqa: E402
from arealjax.generation.engine import Engine  # noqa: E402
from arealjax.generation.generator import Generator  # noqa: E402
from arealjax.generation.local import WeightSync  # noqa: E402
from arealjax.models.lora import add_lora  # noqa: E402
from arealjax.rl.optim import OptimConfig  # noqa: E402
from arealjax.rl.trainer import Trainer, TrainerConfig  # noqa: E402
from arealjax.rl.trajectory import Trajectory  # noqa: E402
from arealjax.runtime import child_env  # noqa: E402
from arealjax.sharding import LogicalSharding, normalize_rules, role_meshes  # noqa: E402
from benchmarks.trainer import best_of  # noqa: E402
from configs import default  # noqa: E402


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def batch(n: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """Default-job-shaped trajectories: prompts of ~8 tokens, answers of 10-40."""
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        p, o = rng.randint(6, 10), rng.randint(10, 41)
        out.append(Trajectory.from_completion(rng.randint(3, vocab, p), rng.randint(3, vocab, o),
                                              rng.normal(-2, 0.3, o), np.zeros(o), advantage=rng.normal(),
                                              group=str(i // 8)))
    return out


def micro(rank: int, repeats: int, smoke: bool = False) -> None:
    config = default.get_config()
    prompts_n, new_tokens = 128, 40
    if smoke:  # the sizes of benchmarks/cells.py SMOKE
        config.model.update(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                            head_dim=16)
        config.rl.batch_size, config.rl.group_size = 4, 2
        config.trainer.max_tokens, config.trainer.micro_rows = 64, 4
        config.generator.slots, config.generator.max_len = 8, 64
        prompts_n, new_tokens = 8, 8
    rules = normalize_rules(config.sharding_rules)
    meshes = role_meshes(config.mesh)
    m = config.model
    cfg = models.ModelConfig.make(**m.to_dict(), vocab_size=48, eos_token_id=1, bos_token_id=2)
    base = models.from_config(cfg, seed=0, mesh=meshes["trainer"], rules=rules)
    lora = models.LoraConfig(rank, 2.0 * rank)
    tcfg = TrainerConfig(max_tokens=config.trainer.max_tokens, micro_rows=config.trainer.micro_rows,
                         optim=OptimConfig(lr=1e-3))
    trajs = batch(config.rl.batch_size * config.rl.group_size, cfg.vocab_size)
    trainers = {"full": Trainer(base, tcfg, mesh=meshes["trainer"], rules=rules),
                f"LoRA r={rank}": Trainer(add_lora(base, lora, mesh=meshes["trainer"], rules=rules), tcfg,
                                          mesh=meshes["trainer"], rules=rules)}
    print(f"Default model ({cfg.num_params() / 1e6:.2f} M params), {len(trajs)} trajectories per step, trainer "
          f"{dict(meshes['trainer'].shape)}, generator {dict(meshes['generator'].shape)}\n")
    print(f"| trained | trainable params | optimizer state | train step (best of {repeats}) |\n|---|---|---|---|")
    steps = {}
    for name, tr in trainers.items():
        steps[name] = best_of(lambda tr=tr: jax.block_until_ready(tr.train_step(trajs) and tr.params), repeats)
    for name, tr in trainers.items():
        print(f"| {name} | {sum(x.size for x in jax.tree.leaves(tr.params)):,} | "
              f"{nbytes(tr.opt_state) / 2**10:,.0f} KiB | {steps[name] * 1e3:.0f} ms |")
    print(f"\nLoRA / full step time: {steps[f'LoRA r={rank}'] / steps['full']:.2f}×")

    print(f"\n| weight sync | bytes moved | seconds (best of {repeats}) |\n|---|---|---|")
    syncs = {"full": WeightSync(trainers["full"].model, meshes["generator"], rules, jnp.float32)}
    adapted = trainers[f"LoRA r={rank}"]
    for mode in ("merged", "on_the_fly"):
        syncs[f"LoRA r={rank}, {mode}"] = WeightSync(adapted.model, meshes["generator"], rules, jnp.float32, mode)
    for name, sync in syncs.items():
        params = (trainers["full"] if name == "full" else adapted).params
        t = best_of(lambda sync=sync, params=params: jax.block_until_ready(sync(params)), repeats)
        print(f"| {name} | {sync.bytes / 2**10:,.1f} KiB | {t * 1e3:.1f} ms |")

    # Generation: B ≠ 0 (trained adapters), the same params merged and on the fly, greedy, alternated rounds.
    adapted.train_step(trajs)
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(3, cfg.vocab_size, rng.randint(6, 10))) for _ in range(prompts_n)]
    sampling = SamplingParams(temperature=0, max_new_tokens=new_tokens, stop_token_ids=())
    g = config.generator
    tps = {}
    gens = {}
    for mode in ("merged", "on_the_fly"):
        sync = syncs[f"LoRA r={rank}, {mode}"]
        engine = Engine(sync.model, slots=g.slots, max_len=g.max_len, page_size=g.page_size,
                        shard=LogicalSharding(meshes["generator"], rules))
        gens[mode] = Generator(engine, sync(adapted.params), decode_steps=g.decode_steps)
        tps[mode] = []
    try:
        for _ in range(repeats):
            for mode, gen in gens.items():
                t0 = time.perf_counter()
                outs = [f.result(timeout=600)[0] for f in [gen.submit(p, sampling) for p in prompts]]
                tps[mode].append(sum(len(o.output_tokens) for o in outs) / (time.perf_counter() - t0))
    finally:
        for gen in gens.values():
            gen.close()
    print(f"\n| generation ({len(prompts)} greedy requests × {new_tokens} tokens, {g.slots} slots) | tokens/s (best of "
          f"{repeats}, first round = compile, dropped) |\n|---|---|")
    best = {mode: max(xs[1:] or xs) for mode, xs in tps.items()}
    for mode, x in best.items():
        print(f"| LoRA r={rank}, {mode} | {x:,.0f} |")
    print(f"\non the fly / merged: {best['on_the_fly'] / best['merged']:.2f}×")


def accuracy(rank: int, lr: float, overrides: list[str] = ()) -> None:
    """The default job, full and LoRA, from one SFT warm start (sft.cache_dir shared)."""
    work = Path(tempfile.mkdtemp(prefix="arealjax-lora-"))
    runs = {"full": [], f"LoRA r={rank}, lr {lr:g}": [f"--config.lora.rank={rank}", f"--config.lora.alpha={2 * rank}",
                                                      f"--config.trainer.optim.lr={lr}"]}
    env = child_env()
    table = {}
    for name, extra in runs.items():
        workdir = work / name.split(",")[0].replace(" ", "_").replace("=", "")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "main.py", "--config=configs/default.py", f"--workdir={workdir}",
                        f"--config.sft.cache_dir={work / 'sft'}", *overrides, *extra], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        table[name] = ({r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r},
                       {r["step"]: r["eval_greedy_accuracy"] for r in rows if "eval_greedy_accuracy" in r},
                       rows[-1].get("wall_seconds", float("nan")), time.perf_counter() - t0,
                       float(np.median([r["weight_sync_seconds"] for r in rows if "weight_sync_seconds" in r])))
        print(f"  {name}: done in {table[name][3]:.0f} s", file=sys.stderr, flush=True)
    steps = sorted(next(iter(table.values()))[0])
    print("\nDefault job, held-out accuracy (pass@1 at T = 1 / greedy) by RL step, one shared SFT warm start:\n")
    print("| trained | " + " | ".join(str(s) for s in steps) + " | RL wall-clock | weight sync (median) |")
    print("|---|" + "---|" * len(steps) + "---|---|")
    for name, (acc, greedy, wall, _, sync) in table.items():
        cells = " | ".join(f"{acc[s]:.2f} / {greedy[s]:.2f}" for s in steps)
        print(f"| {name} | {cells} | {wall:.0f} s | {sync * 1e3:.1f} ms |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--lr", type=float, default=5e-3, help="LoRA's learning rate in the accuracy runs")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.rank, args.repeats = 2, 1
    micro(args.rank, args.repeats, args.smoke)
    if args.accuracy:
        from benchmarks.cells import SMOKE

        accuracy(args.rank, args.lr, SMOKE if args.smoke else [])


if __name__ == "__main__":
    main()
