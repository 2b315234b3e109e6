"""Mixture-of-experts layer: the dropless grouped experts of arealjax/models/transformer.py (tokens sorted by expert,
run in tiles) against the two other ways to compute the same thing, side by side in one run on this machine.

  python benchmarks/moe.py            # the table of docs/model.md, "Mixture of experts" (minutes on 2 CPU cores)
  python benchmarks/moe.py --smoke    # tiny sizes, seconds: the script works (results in a scratch directory)

For each size (tokens N, width D, expert width F, experts E, top k): seconds of one jitted forward + backward
(gradients of the expert weights and the tokens) of
  grouped     `transformer.grouped_experts`, the model's: matmuls over N·k + E·C rows (C: a tile)
  dense       every token through every expert (einsums over the expert axis), weighted by its top-k weights
  ragged_dot  `jax.lax.ragged_dot` over the tokens sorted by expert (what this JAX lowers it to decides its cost)
each checked equal to `dense` (largest absolute difference), and the compiled program's temporary memory
(`memory_analysis`). Writes benchmarks/results/moe.{json,md} (--smoke: --work/smoke).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (tokens, width, expert width, experts, top k)
SIZES = {"full": [(4096, 256, 128, 32, 4), (2048, 512, 256, 64, 8), (8192, 256, 128, 8, 2), (64, 512, 256, 64, 8)],
         "smoke": [(64, 32, 16, 8, 2)]}


def dense_experts(x, experts, weights, mlp):
    """Every token through every expert (einsums over the expert axis), weighted by its masked top-k weights: the
    reference the grouped computation must equal."""
    import jax
    import jax.numpy as jnp

    e = mlp.gate_proj.kernel.shape[0]
    combine = jnp.sum(jax.nn.one_hot(experts, e, dtype=x.dtype) * weights[..., None], axis=1)  # [N, E]
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", x, mlp.gate_proj.kernel[...]))
    h = h * jnp.einsum("nd,edf->nef", x, mlp.up_proj.kernel[...])
    return jnp.einsum("nef,efd,ne->nd", h, mlp.down_proj.kernel[...], combine)


def ragged_experts(x, experts, weights, mlp):
    """The (token, expert) pairs sorted by expert through `jax.lax.ragged_dot`, one group per expert."""
    import jax
    import jax.numpy as jnp

    n, k = experts.shape
    e = mlp.gate_proj.kernel.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, mlp.gate_proj.kernel[...], sizes))
    h = h * jax.lax.ragged_dot(xs, mlp.up_proj.kernel[...], sizes)
    ys = jax.lax.ragged_dot(h, mlp.down_proj.kernel[...], sizes)
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    return jnp.sum(ys[unsort].reshape(n, k, -1) * weights[..., None], axis=1)


def case(n: int, d: int, f: int, e: int, k: int, seed: int = 0):
    """Stacked experts and N tokens routed to their top k of random router logits, half of them to one hot expert
    (groups of very different sizes, as real routers make)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from arealjax.models import ModelConfig
    from arealjax.models.transformer import MLP, _stacked

    cfg = ModelConfig.make(family="qwen3_moe", vocab_size=8, hidden_size=d, intermediate_size=f, num_layers=1,
                           num_heads=1, num_kv_heads=1, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f)
    mlp = _stacked(e, "expert", lambda r: MLP(cfg, jnp.float32, r, width=f), nnx.Rngs(seed))
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    logits = rng.normal(size=(n, e))
    logits[: n // 2, 0] += 4
    experts = jnp.asarray(np.argsort(-logits, axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
    return mlp, x, experts, weights


def measure(size: tuple, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from arealjax.models.transformer import grouped_experts

    n, d, f, e, k = size
    mlp, x, experts, weights = case(n, d, f, e, k)
    graphdef, params = nnx.split(mlp)
    row: dict = dict(tokens=n, width=d, expert_width=f, experts=e, k=k)
    outs = {}
    for name, fn in (("dense", dense_experts), ("grouped", grouped_experts), ("ragged_dot", ragged_experts)):
        def loss(p, x, fn=fn):
            y = fn(x, experts, weights, nnx.merge(graphdef, p))
            return jnp.sum(y * jnp.cos(x)), y

        step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
        compiled = step.lower(params, x).compile()
        memory = compiled.memory_analysis()
        _, outs[name] = jax.block_until_ready(step(params, x))  # compiles
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, x))
            times.append(time.perf_counter() - t0)
        row[name] = dict(seconds=sorted(times)[len(times) // 2],
                         temp_mb=getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory else None,
                         max_abs_diff=float(np.max(np.abs(np.asarray(outs[name]) - np.asarray(outs["dense"])))))
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)} | {name: row[name]}), flush=True)
    row["dense_over_grouped"] = row["dense"]["seconds"] / row["grouped"]["seconds"]
    row["ragged_over_grouped"] = row["ragged_dot"]["seconds"] / row["grouped"]["seconds"]
    return row


def report(res: dict) -> str:
    lines = ["# Mixture-of-experts layer: grouped experts vs dense vs ragged_dot", "",
             f"`{res['command']}` at `{res['commit']}`, {res['device']}, {res['date']}.", "",
             "Forward + backward of one expert layer (fp32; median of the repeats), the compiled program's "
             "temporary memory, and each output's largest difference from the dense reference.", "",
             "| N | D | F | E | k | grouped | dense | ragged_dot | dense / grouped | ragged_dot / grouped | "
             "temp MiB grouped / dense / ragged_dot | max diff grouped / ragged_dot |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        g, dn, rg = r["grouped"], r["dense"], r["ragged_dot"]
        mem = " / ".join("—" if m["temp_mb"] is None else f"{m['temp_mb']:.0f}" for m in (g, dn, rg))
        lines.append(f"| {r['tokens']} | {r['width']} | {r['expert_width']} | {r['experts']} | {r['k']} | "
                     f"{g['seconds']:.3f} s | {dn['seconds']:.3f} s | {rg['seconds']:.3f} s | "
                     f"{r['dense_over_grouped']:.2f}x | {r['ragged_over_grouped']:.2f}x | {mem} | "
                     f"{g['max_abs_diff']:.1e} / {rg['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; results in --work/smoke")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "arealjax_moe"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    import jax

    from benchmarks.cells import commit, portable

    results = Path(args.work) / "smoke" if args.smoke else Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    rows = [measure(s, 1 if args.smoke else args.repeats) for s in SIZES["smoke" if args.smoke else "full"]]
    res = {"command": " ".join(["python benchmarks/moe.py", *portable(sys.argv[1:])]), "commit": commit(),
           "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
           "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    (results / "moe.json").write_text(json.dumps(res, indent=1) + "\n")
    (results / "moe.md").write_text(report(res))
    print(report(res))


if __name__ == "__main__":
    main()
