"""The trainer: one RL step = packed micro-batches -> π_prox pass -> minibatch updates -> new params.

    trainer = Trainer(model, TrainerConfig(...), mesh=meshes["trainer"])
    metrics = trainer.train_step(trajectories)     # trainer.params and trainer.version move on

Params and optimizer state live sharded on the trainer mesh by the logical rules; micro-batches are sharded over
the batch (data-parallel) axes. Three jitted functions with explicit shardings, compiled for a few shapes only:
micro-batches are [R, T] but a minibatch's last, which has the fewest power-of-two rows that hold the rest
(packing.micro_sizes), and the head scores a micro-batch's loss positions only, in slots rounded up to an eighth
of its positions or 128 (`loss_positions`), or a size already compiled that holds them at most twice over (`reused`):
  logprobs  no-grad forward -> logprob of each target token (the π_prox pass, and the reference policy's)
  grad      gradient of one micro-batch's share of the minibatch loss, added into an fp32 accumulator
  apply     global-norm clip + AdamW; if the loss or a gradient is not finite, params and state are kept
Dividing every micro-batch's loss by the minibatch's global trained-token count makes the accumulated gradient
that of the whole minibatch, however it is split into micro-batches or over devices.

Mixture-of-experts models: with `router_replay` the π_θ, π_prox and reference passes send each token through the
experts the generator chose for it (the batch's `routes`), the router still trained through its probabilities of
them; every step reports `router_disagreement`, the share of a token's k experts the trainer's own router would
not have chosen (the training-inference routing mismatch), replayed or not. SFT adds the router's load-balancing
loss (`router_aux_loss_coef` of the model config).

Memory knobs (TrainerConfig; none moves the numbers beyond float tolerance): the attention kernel, per-layer
remat ("auto": the least recomputation whose train step the compiler fits in the device's free memory), logits
computed `logits_chunk` tokens of a row at a time (never tokens × vocab at once), and bf16 compute on fp32 master
params. benchmarks/memory.py measures what each buys on real model shapes.

The device functions and their memory are rl/steps.py's, the optimizer rl/optim.py's; this module owns the config,
the packing into minibatches and micro-batches, the passes and the step's metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arealjax.distributed import Processes, put_rows
from arealjax.models import Model, lora
from arealjax.models import attention as attn
from arealjax.models.transformer import REMAT, remat_policy
from arealjax.rl.losses import PPOConfig, lag_metrics
from arealjax.rl.optim import OptimConfig, check_schedule, make_optimizer, make_schedule
from arealjax.rl.packing import PackedBatch, micro_sizes, pack, split_minibatches
from arealjax.rl.steps import (
    COMPUTE_DTYPES,
    choose_remat,
    grad_step_bytes,
    make_steps,
    memory_budget,
    scalar_args,
    shares_prefixes,
)
from arealjax.rl.trajectory import Trajectory
from arealjax.sharding import DEFAULT_RULES, Rules
from arealjax.validate import Problems, ints

# The head scores a micro-batch's loss positions in slots of 1/LOSS_BUCKETS of its positions per shard, and never
# finer than LOSS_GRANULE slots: a smaller gather saves too little to pay for a compilation of its own.
LOSS_BUCKETS = 8
LOSS_GRANULE = 128


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The `trainer` section: the objective and its hyper-parameters (`ppo`: an RL objective of rl/losses.py, or
    "sft" for the warm start), the optimizer, the packed rows and micro-batches, and the memory and speed knobs."""

    ppo: PPOConfig = PPOConfig()
    optim: OptimConfig = OptimConfig()
    max_tokens: int = 256  # T: tokens per packed row (≥ the longest trajectory)
    micro_rows: int = 8  # R: rows per micro-batch (a multiple of the data-parallel size)
    ppo_n_minibatches: int = 1  # optimizer steps per RL step
    packing: bool = True  # False: one trajectory per row (the naive baseline)
    # A group's prompt and an agent's history computed once, as a tree (rl/prefix_tree.py), where the attention
    # kind reads trees (models/attention.TREES; otherwise packed flat, said at start-up). Same values either way.
    share_prefixes: bool = True
    router_replay: bool = False  # MoE: route every token through the experts the generator chose (its `routes`)
    # Memory / speed knobs; none changes the numbers beyond float tolerance.
    attention: str = "auto"  # training attention kernel (models/attention.py)
    remat: str = "none"  # per-layer rematerialisation: none | full | save_dots | offload (models/transformer.py)
    # | auto (the least recomputation whose gradient program fits the device's memory: `choose_remat`)
    scan_layers: bool = True  # False unrolls the layers (compile time grows with depth)
    logits_chunk: int = 1024  # tokens per row whose logits exist at once (0: the whole row)
    compute_dtype: str = "float32"  # "bfloat16": bf16 matmuls on fp32 master params; softmax/logprobs stay fp32
    max_skipped_in_a_row: int = 3  # steps skipped for a non-finite loss or gradient before the run stops

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"TrainerConfig.compute_dtype = '{self.compute_dtype}'; expected one of "
                             f"{sorted(COMPUTE_DTYPES)}")
        if self.logits_chunk < 0:
            raise ValueError(f"TrainerConfig.logits_chunk = {self.logits_chunk}; expected ≥ 0 (0: no chunking)")
        for name, known in (("attention", attn.pick), ("remat", lambda r: r == "auto" or remat_policy(r))):
            try:
                known(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"TrainerConfig.{name} = {getattr(self, name)!r}: {e}") from None

    @property
    def supervised(self) -> bool:
        """Whether the objective is supervised fine-tuning (`ppo.objective = "sft"`, the warm start's)."""
        return self.ppo.spec.supervised


def check(config: Any, problems: Problems) -> None:
    """The trainer section (trainer.*, with trainer.ppo and trainer.optim), at start-up."""
    t, need = config.trainer, problems.need
    problems.positive("trainer.max_tokens", "trainer.micro_rows", "trainer.ppo_n_minibatches",
                      "trainer.max_skipped_in_a_row")
    problems.positive("trainer.logits_chunk", minimum=0)
    need(t.attention in attn.KINDS, "trainer.attention", f"one of {attn.KINDS}")
    need(t.remat in (*REMAT, "auto"), "trainer.remat", f"one of {(*REMAT, 'auto')}")
    need(t.remat != "offload" or jax.default_backend() in ("gpu", "tpu"), "trainer.remat",
         f"not 'offload' on {jax.default_backend()} (host offload needs a GPU or TPU)")
    need(t.compute_dtype in COMPUTE_DTYPES, "trainer.compute_dtype", f"one of {sorted(COMPUTE_DTYPES)}")
    need(t.ppo.objective != "sft", "trainer.ppo.objective", "an RL objective ('sft' is the warm start's: sft.*)")
    check_schedule(t.optim, "trainer.optim", problems)
    g, rl = config.generator, config.rl
    if ints(g.max_len, t.max_tokens):
        need(t.max_tokens >= g.max_len, "trainer.max_tokens", f"≥ generator.max_len = {g.max_len}: a trajectory "
             f"can be as long as the generator's context, and a packed row must hold it")
    if ints(t.ppo_n_minibatches, rl.batch_size):
        need(t.ppo_n_minibatches <= rl.batch_size, "trainer.ppo_n_minibatches",
             f"≤ rl.batch_size = {rl.batch_size} (every minibatch needs a trajectory)")


def loss_positions(mask: np.ndarray, shards: int = 1) -> int | None:
    """How many positions per batch shard the head scores for a micro-batch with loss mask `mask` [R, T] (rows
    split evenly over `shards`, in order): its fullest shard's loss tokens rounded up to the next 1/LOSS_BUCKETS of
    the shard's positions (at least LOSS_GRANULE), so a run compiles at most LOSS_BUCKETS programs per micro-batch
    shape; None (every position, no gather) where that rounds up to all of them."""
    per_shard = np.asarray(mask).reshape(shards, -1)
    positions = per_shard.shape[1]
    granule = max(-(-positions // LOSS_BUCKETS), LOSS_GRANULE)
    size = -(-max(int(per_shard.sum(1).max()), 1) // granule) * granule
    return None if size >= positions else size


def reused(size: int | None, met: list[int | None], positions: int) -> int | None:
    """`size` (`loss_positions` of a micro-batch shape with `positions` per shard), or the smallest size in `met`,
    those this shape has been run with, that holds it at most twice over (None: every position); `size` joins `met`
    where none does. Where the loss tokens per micro-batch wander (agents' shared prefixes), each new size is a
    compilation (minutes on a CPU): this keeps them to ~log2(LOSS_BUCKETS) per shape, at a head over at most twice
    the slots needed (masked slots: the numbers do not change). Deterministic in the sequence of sizes, so processes
    that agree on each size agree on this."""
    slots = lambda k: positions if k is None else k  # noqa: E731
    if fits := [k for k in met if slots(size) <= slots(k) <= 2 * slots(size)]:
        return min(fits, key=slots)
    met.append(size)
    return size


class Trainer:
    """Owns the trainer-mesh params and optimizer state; `version` counts completed RL steps.

    A model with LoRA adapters (models/lora.py) trains the adapters only: `params` and the optimizer state are
    the adapters', and the base weights are `frozen` (read by every step, never differentiated or updated)."""

    def __init__(self, model: Model, cfg: TrainerConfig, *, mesh: jax.sharding.Mesh | None = None,
                 rules: Rules = DEFAULT_RULES, ref_params: nnx.State | None = None, version: int = 0,
                 processes: Processes | None = None):
        """`processes` (multi-host, arealjax/distributed.py): `mesh` spans every process, each of which calls
        `train_step` with its own share of the batch; micro-batches are `micro_rows / processes` rows each here."""
        if mesh is not None:
            model = model.to_mesh(mesh, rules)
        self.cfg, self.model_cfg, self.graphdef, self.lora = cfg, model.cfg, model.graphdef, model.lora
        self.processes = processes
        if cfg.share_prefixes and cfg.packing and not shares_prefixes(cfg):
            logging.warning("trainer.attention '%s' cannot read a tree of shared prefixes (kinds that can: %s): "
                            "trajectories are packed whole (trainer.share_prefixes has no effect)", cfg.attention,
                            attn.TREES)
        count = processes.count if processes else 1
        if cfg.micro_rows % count:
            raise ValueError(f"trainer.micro_rows = {cfg.micro_rows} must be a multiple of the {count} processes")
        self._count, self._rows = count, cfg.micro_rows // count
        self.version = version
        self.skipped_steps = 0
        self.tx = make_optimizer(cfg.optim)
        trainable, self.frozen = lora.split(model.params) if model.lora else (model.params, nnx.State({}))
        if cfg.remat == "auto":  # before the trainer's own params and state exist: they are part of what must fit
            routes = (model.cfg.num_layers, model.cfg.num_experts_per_tok) if model.cfg.num_experts else None

            def need(policy: str) -> tuple[int, int]:
                return grad_step_bytes(model.graphdef, trainable, dataclasses.replace(cfg, remat=policy), self.tx,
                                       mesh, rules, self.frozen, routes)

            cfg = self.cfg = dataclasses.replace(cfg, remat=choose_remat(need, self._budget(mesh)))
        steps = make_steps(model.graphdef, trainable, cfg, self.tx, mesh, rules, self.frozen)
        # A micro-batch's rows split over `shards` devices; the last micro-batch of a minibatch may be smaller
        # (packing.micro_sizes), in a multiple of `unit` rows here so that it still splits evenly.
        unit = steps.shards // math.gcd(steps.shards, count)
        self._unit = unit if self._rows % unit == 0 else self._rows
        # Each process's rows are whole shards of the micro-batch when the shards are a multiple of the processes;
        # otherwise loss positions are not counted per shard here and the head scores every position.
        self._local_shards = steps.shards // count if steps.shards % count == 0 else None
        if not cfg.supervised and cfg.ppo.kl_coef and ref_params is None:
            ref_params = trainable  # the initial policy is the reference
        self.ref_params = ref_params if mesh is None or ref_params is None else jax.device_put(ref_params, steps.p_sh)
        # The step donates params: own a copy so the caller's model (and a colocated generator) stay valid.
        self.params = steps.copy(trainable)
        self.opt_state = steps.init(self.params)
        self._b_sh = steps.b_sh
        self._zeros, self._logprobs, self._grad, self._apply = steps.zeros, steps.logprobs, steps.grad, steps.apply
        self._minibatch_stat = steps.minibatch_stat
        self._drift_warned = False
        self._sizes_met: dict[tuple[int, ...], list[int | None]] = {}  # per micro-batch shape (`reused`)
        self._schedule = make_schedule(cfg.optim)
        self.optimizer_steps = 0

    def _budget(self, mesh: jax.sharding.Mesh | None) -> tuple[int, int] | None:
        """`memory_budget` of this process's first trainer device, each the least over the processes (None:
        unknown)."""
        device = mesh.local_devices[0] if mesh is not None else jax.local_devices()[0]
        budget = memory_budget(device)
        every = self.processes.allgather("memory_budget", budget) if self.processes else [budget]
        return None if None in every else tuple(min(x) for x in zip(*every))

    @property
    def model(self) -> Model:
        return Model(self.model_cfg, self.graphdef, nnx.merge_state(self.params, self.frozen), self.lora)

    def _put(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return put_rows(arrays, self._b_sh, self._count)  # one transfer call per micro-batch on one host

    def pack(self, trajectories: Sequence[Trajectory]) -> list[PackedBatch]:
        """The RL step's minibatches (this process's share of each), packed into micro-batches."""
        cfg = self.cfg
        n = 1 if cfg.supervised else cfg.ppo_n_minibatches
        return [pack(mb, cfg.max_tokens, self._rows, packed=cfg.packing, routes=bool(self.model_cfg.num_experts),
                     unit=self._unit, share_prefixes=shares_prefixes(cfg)) for mb in split_minibatches(trajectories, n)]

    def _loss_sizes(self, batch: PackedBatch) -> list[int | None]:
        """Per micro-batch, the positions per shard its head scores (`loss_positions`; this process's rows)."""
        if self._local_shards is None:
            return [None] * batch.n_micro
        return [loss_positions(batch.micro(i)["loss_mask"], self._local_shards) for i in range(batch.n_micro)]

    def _agree(self, batches: list[PackedBatch]) -> tuple[list[PackedBatch], np.ndarray, list[list[int | None]]]:
        """Every process's minibatches padded to the same micro-batch shapes (those of the most rows among them),
        per minibatch the counts over all processes: [rows (all processes', padding included), loss tokens,
        tokens computed, sequences, tokens represented], and per micro-batch the positions per shard its head scores
        (the most any needs, or a size its shape ran with that holds it: `reused`)."""
        local = [[b.n_rows, b.n_loss_tokens, b.n_tokens, b.n_sequences, b.n_represented] for b in batches]
        rows = np.array(self.processes.allgather("pack", local) if self.processes else [local], np.int64)
        totals = rows.sum(0)
        batches = [b.padded(micro_sizes(int(n), self._rows, self._unit)) for b, n in zip(batches, rows[:, :, 0].max(0))]
        totals[:, 0] = [self._count * b.n_rows for b in batches]
        sizes = [self._loss_sizes(b) for b in batches]
        if self.processes:
            every = self.processes.allgather("loss_positions", sizes)
            sizes = [[None if None in ks else max(ks) for ks in zip(*per_batch)] for per_batch in zip(*every)]
        if self._local_shards is not None:
            sizes = [[reused(k, self._sizes_met.setdefault(m.shape, []), m.size // self._local_shards)
                      for k, m in zip(ks, (b.micro(i)["loss_mask"] for i in range(b.n_micro)))]
                     for ks, b in zip(sizes, batches)]
        return batches, totals, sizes

    def logprobs(self, params: nnx.State, batch: PackedBatch) -> list[jax.Array]:
        """Per-target-token logprobs [rows, T] of every micro-batch under `params` (no gradient), at the loss
        positions (0 elsewhere)."""
        return [self._logprobs(params, self.frozen, self._put(batch.micro(i)), k)
                for i, k in enumerate(self._loss_sizes(batch))]

    def gradients(self, batch: PackedBatch) -> tuple[nnx.State, float, dict[str, float]]:
        """fp32 gradient and value of one packed minibatch's loss at the current params (π_prox = current
        params), and the summed diagnostics: what one optimizer step of `train_step` applies."""
        sums: dict[str, Any] = {}
        micro, sizes = [self._put(batch.micro(i)) for i in range(batch.n_micro)], self._loss_sizes(batch)
        prox, ref = self._prox_and_ref(micro, sizes, first=True)
        grads, loss_value = self._accumulate(batch.n_loss_tokens, micro, sizes, prox, ref, sums)
        return grads, float(loss_value), jax.device_get(sums)

    def _prox_and_ref(self, micro: list, sizes: list, first: bool) -> tuple[list, list]:
        """π_prox's and the reference policy's logprobs of a minibatch's micro-batches at the current params (None
        where the loss does not need them). π_prox: params at the start of the step. The step's first minibatch is
        differentiated at exactly those params, so its loss takes a stop-gradient copy of its own logprobs instead of
        a separate pass (with one minibatch, every micro-batch does); the later ones need the pass, before the first
        update. An objective's minibatch statistic (M2PO's mask) needs π_prox of a whole minibatch before its
        gradients: the pass for every minibatch. The reference's: with a KL penalty."""
        prox = self.cfg.ppo.spec.needs_prox and (not first or self._minibatch_stat is not None)
        ref = not self.cfg.supervised and bool(self.cfg.ppo.kl_coef)
        passes = lambda params, on: [self._logprobs(params, self.frozen, m, k) if on else None  # noqa: E731
                                     for m, k in zip(micro, sizes)]
        return passes(self.params, prox), passes(self.ref_params, ref)

    def _accumulate(self, n_loss_tokens: int, micro: list, sizes: list, prox: list, ref: list,
                    sums: dict) -> tuple[Any, Any]:
        """Sum of micro-batch gradients of the minibatch loss (each divided by the minibatch's token count)."""
        stat = (self._minibatch_stat(tuple(prox), tuple(m["behav_logp"] for m in micro),
                                     tuple(m["loss_mask"] for m in micro))
                if self._minibatch_stat else np.inf)  # a statistic of the whole minibatch (M2PO's mask)
        scalars = scalar_args(max(n_loss_tokens, 1), stat, self.version)
        acc = self._zeros(self.params)
        loss_value = jnp.float32(0.0)
        for m, k, p, r in zip(micro, sizes, prox, ref):
            acc, metrics = self._grad(self.params, self.frozen, acc, m, p, r, scalars, k)
            loss_value = loss_value + metrics.pop("loss")
            for k, v in metrics.items():
                sums[k] = jnp.maximum(sums[k], v) if k.endswith("_max") and k in sums else sums.get(k, 0) + v
        return acc, loss_value

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One RL step (or SFT step) on a batch of trajectories; bumps `version`. Returns metrics."""
        t0 = time.perf_counter()
        batches, totals, sizes = self._agree(self.pack(trajectories))
        micro = [[self._put(b.micro(i)) for i in range(b.n_micro)] for b in batches]
        passes = [self._prox_and_ref(ms, ks, first=i == 0) for i, (ms, ks) in enumerate(zip(micro, sizes))]
        sums: dict[str, Any] = {}
        step_stats = []
        for n_loss_tokens, ms, ks, (ps, rs) in zip(totals[:, 1], micro, sizes, passes):
            grads, loss_value = self._accumulate(int(n_loss_tokens), ms, ks, ps, rs, sums)
            lr = self._schedule(self.optimizer_steps + len(step_stats) - self.skipped_steps)
            self.params, self.opt_state, grad_norm, ok = self._apply(self.params, self.opt_state, grads, loss_value)
            step_stats.append((loss_value, grad_norm, ok, lr))
        sums, step_stats = jax.device_get((sums, step_stats))
        skipped = sum(not ok for _, _, ok, _ in step_stats)
        self.optimizer_steps += len(step_stats)
        self.skipped_steps += skipped  # a skipped update does not advance the schedule (optax state is kept)
        self.version += 1
        out = self._report(sums, totals, sum(b.n_micro for b in batches))
        out.update(loss=float(np.mean([s[0] for s in step_stats])), grad_norm=float(np.max([s[1] for s in step_stats])),
                   lr=float(step_stats[-1][3]), skipped_steps=skipped, version=self.version,
                   step_seconds=time.perf_counter() - t0)
        out["tokens_per_s"] = out["tokens"] / out["step_seconds"]
        out["trained_tokens_per_s"] = out["trained_tokens"] / out["step_seconds"]
        self._warn_drift(out)
        return out

    def _warn_drift(self, out: dict[str, float]) -> None:
        """Once per run: stale tokens whose behaviour policy has drifted further than ppo.drift_warning from π_prox
        (the objective's correction is then doing much of the work, or failing to)."""
        limit = 0 if self.cfg.supervised else self.cfg.ppo.drift_warning
        stale = {k: v for k, v in out.items() if k.endswith("_kl_behaviour_prox") and not k.startswith("lag0_")}
        if self._drift_warned or not limit or not stale or max(stale.values()) <= limit:
            return
        self._drift_warned = True
        lag = max(stale, key=stale.get).split("_")[0]
        logging.warning(
            "off-policy drift: tokens %s versions stale are %.3f nats/token from π_prox (KL(μ ‖ π_prox); %.3f per "
            "version; trainer.ppo.drift_warning = %g); their behaviour weights π_prox/μ span %.2f–%.2f (5th–95th "
            "percentile) and the objective masked %.0f%% of them. LLM RL drifts ~0.001 per version: a lower "
            "learning rate, a larger batch, a smaller rl.max_staleness or an off-policy correction "
            "(docs/objectives.md) keeps asynchrony from costing accuracy.", lag[3:], stale[f"{lag}_kl_behaviour_prox"],
            out.get("kl_behaviour_prox_per_version", float("nan")), limit, out[f"{lag}_w_p05"], out[f"{lag}_w_p95"],
            100 * out[f"{lag}_masked_fraction"])

    def _report(self, sums: dict[str, float], totals: np.ndarray, n_micro: int) -> dict[str, float]:
        """Step metrics over the whole batch (every process's share); `totals` as `_agree` returns them."""
        tokens = max(float(sums.get("tokens", 0.0)), 1.0)
        rows, _, n_tokens, n_sequences, represented = totals.sum(0)
        out = {"tokens": float(n_tokens), "trained_tokens": float(sums.get("tokens", 0.0)),
               "shared_fraction": float(1 - n_tokens / max(represented, 1)),
               "sequences": float(n_sequences), "non_padding_fraction": float(n_tokens / (rows * self.cfg.max_tokens)),
               "micro_batches": float(n_micro),
               "entropy": float(sums["entropy_sum"]) / tokens}
        if "routed_experts" in sums:
            out["router_disagreement"] = float(sums["router_disagreement_sum"]) / max(float(sums["routed_experts"]), 1)
        if "aux_loss_sum" in sums:
            out["router_aux_loss"] = float(sums["aux_loss_sum"]) / len(totals)
        if "nll_sum" in sums:
            out["nll"] = float(sums["nll_sum"]) / tokens
            return out
        valid = max(float(sums["valid_tokens"]), 1.0)
        out.update(clip_fraction=float(sums["clipped_tokens"]) / valid,
                   dual_clip_fraction=float(sums["dual_clipped_tokens"]) / valid,
                   masked_fraction=float(sums["masked_tokens"]) / tokens,
                   behaviour_weight_mean=float(sums["behaviour_weight_sum"]) / valid,
                   behaviour_weight_max=float(sums["behaviour_weight_max"]),
                   approx_kl=float(sums["kl_prox_theta_sum"]) / valid,
                   kl_behaviour_prox=float(sums["kl_behav_prox_sum"]) / valid)
        if "lag_tokens" in sums:
            out.update(lag_metrics(sums))
        return out
