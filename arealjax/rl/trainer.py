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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from arealjax.distributed import Processes, put_rows
from arealjax.models import Model, lora
from arealjax.models import attention as attn
from arealjax.models.transformer import HIDDEN_AXES, REMAT, load_balancing_loss, remat_policy
from arealjax.rl.losses import PPOConfig, lag_metrics, ppo_loss
from arealjax.rl.packing import FIELDS, FLOATS, PackedBatch, micro_sizes, pack, split_minibatches
from arealjax.rl.trajectory import Trajectory
from arealjax.sharding import DEFAULT_RULES, LogicalSharding, Rules, constrain, tree_shardings
from arealjax.validate import Problems, ints

COMPUTE_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}  # None: compute in the params' dtype
SCHEDULES = ("constant", "cosine")
# The head scores a micro-batch's loss positions in slots of 1/LOSS_BUCKETS of its positions per shard, and never
# finer than LOSS_GRANULE slots: a smaller gather saves too little to pay for a compilation of its own.
LOSS_BUCKETS = 8
LOSS_GRANULE = 128
# trainer.remat = "auto": the first of these whose gradient program fits the device's free memory and whose
# temporaries (one allocation) fit its allocator's largest free block, each less a margin (what the compiler's
# estimate leaves out); none fits: the last. No memory statistics (CPU): REMAT_DEFAULT.
REMAT_AUTO = ("none", "save_dots", "full")
REMAT_MARGIN = 0.1
REMAT_DEFAULT = "none"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then constant or cosine decay (to min_lr_ratio·lr at total_steps)."""

    lr: float = 1e-5
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0  # optimizer steps; needed by cosine
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0  # applied to matrices only, not to norms and biases
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-5
    grad_clip: float = 1.0  # global norm; 0 = off

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimConfig.schedule = '{self.schedule}'; expected one of {SCHEDULES}")


def check_schedule(optim: OptimConfig, key: str, problems: Problems) -> None:
    """What `optim`'s schedule needs of the run's length (`key`: its section, e.g. 'sft.optim')."""
    if optim.schedule == "cosine" and optim.total_steps <= optim.warmup_steps:
        problems.append(f"{key}.total_steps = {optim.total_steps}: expected > {key}.warmup_steps = "
                        f"{optim.warmup_steps} with a cosine schedule")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    if cfg.schedule == "cosine":
        if cfg.total_steps <= cfg.warmup_steps:
            raise ValueError(f"cosine schedule needs total_steps (= {cfg.total_steps}) > warmup_steps "
                             f"(= {cfg.warmup_steps})")
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.total_steps,
                                                  cfg.lr * cfg.min_lr_ratio)
    if cfg.warmup_steps:
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps),
                                     optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])
    return optax.constant_schedule(cfg.lr)


def decay_mask(params: nnx.State) -> nnx.State:
    """True for the params weight decay applies to: matrices (kernels, embeddings, LoRA factors), not norm scales
    or biases. Decided by what a param is (its name and logical axes), not its rank: stacked layers give every
    norm scale a [layers, dim] shape, and attention biases are [heads, head_dim]."""
    def one(path, v: nnx.Variable) -> nnx.Variable:
        return v.replace(value=path[-1].key != "bias" and "norm" not in v.get_metadata()["axes"])

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw


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


def shares_prefixes(cfg: TrainerConfig) -> bool:
    """Whether the trainer packs trees of shared prefixes: asked for, packed, and an attention kind that reads them."""
    return cfg.share_prefixes and cfg.packing and attn.pick(cfg.attention) in attn.TREES


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head_logits_low(x: jax.Array, w: jax.Array, eq: str) -> jax.Array:
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)


def _head_low_fwd(x, w, eq):
    return _head_logits_low(x, w, eq), (x, w)


def _head_low_bwd(eq, res, g):
    x, w = res
    ws = eq.split(",")[1].split("->")[0]  # w's subscripts: "vd" (tied embedding) or "dv" (lm_head)
    g = g.astype(x.dtype)
    return (jnp.einsum(f"nv,{ws}->nd", g, w, preferred_element_type=jnp.float32).astype(x.dtype),
            jnp.einsum(f"nd,nv->{ws}", x, g, preferred_element_type=jnp.float32).astype(w.dtype))


_head_logits_low.defvjp(_head_low_fwd, _head_low_bwd)


def head_logits(x: jax.Array, head: tuple[jax.Array, str]) -> jax.Array:
    """fp32 logits of hidden states x [N, D] against the output projection `head` (model.head()). In a compute dtype
    below fp32 (bf16) the backward's two GEMMs run in it too, the fp32 cotangent rounded to it and accumulated in
    fp32, as the forward's: autodiff would promote both to fp32 (TF32 on a GPU: a tenth of an H200's bf16 PPO step
    for Qwen3-0.6B). In fp32, plain autodiff."""
    w, eq = head
    if x.dtype == jnp.float32 and w.dtype == jnp.float32:
        return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)
    return _head_logits_low(x, w, eq)


def loss_logprobs(hidden: jax.Array, head: tuple[jax.Array, str], targets: jax.Array, temperature: jax.Array,
                  mask: jax.Array, size: int | None, chunk: int, shards: int = 1,
                  shard: LogicalSharding | None = None) -> tuple[jax.Array, jax.Array]:
    """log π(target) and the entropy of π, fp32, for π = softmax(logits / temperature) (the distribution the tokens
    were sampled from: AReaL ties the actor's temperature to the sampling one), at the loss positions `mask` [B, T]
    and 0 elsewhere: nothing reads another position, and prompts and padding cost a vocabulary projection each.

    Per batch shard (B splits over `shards` in order), the hidden states [B, T, D] of its loss positions are gathered
    into `size` slots (static: `loss_positions`; None: every position, no gather) and projected onto the
    vocabulary `chunk` × B / shards slots at a time under a rematerialised scan, so neither pass holds more logits
    than `chunk` tokens of each row (Qwen's 151,936-word vocabulary makes one 8k-token row's fp32 logits ~5 GB).
    Each chunk's logits are reduced in one log-sum-exp pass (log π = logit − lse, entropy = −Σ p·(logit − lse)),
    and the results scattered back. Same values and gradients as a log-softmax of the full logits."""
    b, t, d = hidden.shape
    n = b * t // shards  # positions per shard
    split = lambda x: x.reshape(shards, n, *x.shape[2:])  # noqa: E731
    slots = n if size is None else size
    steps = 1 if chunk <= 0 else -(-slots // max(chunk * b // shards, 1))
    c = -(-slots // steps)  # slots per chunk
    if size is None:  # every position, padded to whole chunks
        pad = lambda x, v=0: jnp.pad(split(x), ((0, 0), (0, steps * c - n), *[(0, 0)] * (x.ndim - 2)),  # noqa: E731
                                     constant_values=v)
        x, tgt, temp = pad(hidden), pad(targets), pad(temperature, 1.0)
    else:  # the loss positions of each shard in order; empty slots point past the end and read its last position
        idx = jax.vmap(lambda m: jnp.nonzero(m, size=steps * c, fill_value=n)[0])(split(mask))  # [S, slots]
        take = lambda x: jnp.take_along_axis(split(x), idx.reshape(*idx.shape, *[1] * (x.ndim - 2)),  # noqa: E731
                                             axis=1, mode="clip")
        x, tgt, temp = constrain(take(hidden), shard, HIDDEN_AXES), take(targets), take(temperature)

    def scores(x, tgt, temp):
        logits = head_logits(x.reshape(-1, d), head).reshape(shards, c, -1)
        z = constrain(logits, shard, ("batch", "length", "vocab")) / temp[..., None]
        lse = jax.nn.logsumexp(z, axis=-1)
        logp = jnp.take_along_axis(z, tgt[..., None], axis=-1)[..., 0] - lse
        z = z - lse[..., None]
        return logp, -jnp.sum(jnp.exp(z) * z, axis=-1)

    if steps == 1:  # one chunk: nothing to save, and no recomputation of the logits
        out = scores(x, tgt, temp)
    else:
        chunks = lambda a: jnp.moveaxis(a.reshape(shards, steps, c, *a.shape[2:]), 1, 0)  # noqa: E731
        _, out = jax.lax.scan(jax.checkpoint(lambda _, xs: (None, scores(*xs))), None,
                              (chunks(x), chunks(tgt), chunks(temp)))
        out = tuple(jnp.moveaxis(a, 0, 1).reshape(shards, steps * c) for a in out)
    if size is None:
        return tuple(jnp.where(mask, a[:, :n].reshape(b, t), 0.0) for a in out)
    rows = jnp.arange(shards)[:, None]
    return tuple(jnp.zeros((shards, n), jnp.float32).at[rows, idx].set(a, mode="drop").reshape(b, t) for a in out)


def disagreement(logits: jax.Array, routes: jax.Array, k: int) -> dict[str, jax.Array]:
    """Of the (token, layer) pairs with recorded routes [..., L, k] (≥ 0), how many of the recorded k experts are
    not among the top k of the router `logits` [..., L, E]: summed (`router_disagreement_sum`) with the count of
    recorded experts (`routed_experts`)."""
    own = jax.lax.top_k(logits, k)[1]
    routes = routes.astype(jnp.int32)
    recorded = routes[..., :1] >= 0
    missed = ~jnp.any(routes[..., :, None] == own[..., None, :], axis=-1) & recorded
    return {"router_disagreement_sum": jnp.sum(missed.astype(jnp.float32)),
            "routed_experts": jnp.sum(jnp.broadcast_to(recorded, routes.shape).astype(jnp.float32))}


def scalar_args(n_tokens: float, minibatch_stat: Any = np.inf, version: int = 0) -> dict[str, Any]:
    """The gradient program's scalars: the minibatch's loss-token count (the loss's divisor), the objective's
    statistic of the minibatch (`Objective.minibatch`: M2PO's cut), and the trainer's version (each token's
    staleness lag = version − the version that sampled it)."""
    stat = np.float32(minibatch_stat) if isinstance(minibatch_stat, float) else minibatch_stat
    return {"n_tokens": np.float32(n_tokens), "minibatch_stat": stat, "version": np.int32(version)}


@dataclasses.dataclass(frozen=True)
class Steps:
    """The trainer's jitted device functions, with explicit shardings on a mesh: what `Trainer` runs, and what
    benchmarks/memory.py lowers with abstract shapes to read a real model's memory without allocating it."""

    copy: Any  # params -> an owned copy
    init: Any  # params -> optimizer state
    zeros: Any  # params -> an fp32 gradient accumulator
    # The last argument of logprobs and grad (static, default None: every position) is the micro-batch's
    # `loss_positions`: how many positions per batch shard the head scores.
    logprobs: Any  # (params, frozen, micro-batch[, size]) -> per-token logprobs [R, T] (0 off the loss mask)
    grad: Any  # (params, frozen, acc, micro-batch, prox, ref, scalar_args(...)[, size]) -> (acc + grad, metrics)
    # (prox, behaviour logprobs, loss masks) of a minibatch's micro-batches -> the objective's statistic of the
    # minibatch (Objective.minibatch: M2PO's cut); None when the objective has none
    minibatch_stat: Any
    apply: Any  # (params, opt_state, grads, loss) -> (params, opt_state, grad_norm, ok)
    p_sh: Any
    f_sh: Any
    o_sh: Any
    b_sh: Any
    shards: int  # batch shards of a micro-batch (b_sh's): the head gathers loss positions within each


def batch_shards(b_sh: NamedSharding | None) -> int:
    """How many ways a micro-batch's rows are split by its sharding (1 without a mesh)."""
    axes = None if b_sh is None else b_sh.spec[0] if len(b_sh.spec) else None
    if axes is None:
        return 1
    return int(np.prod([b_sh.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))


def make_steps(graphdef: nnx.GraphDef, params: nnx.State, cfg: TrainerConfig, tx: optax.GradientTransformation,
               mesh: jax.sharding.Mesh | None = None, rules: Rules = DEFAULT_RULES,
               frozen: nnx.State | None = None) -> Steps:
    """The jitted step functions for a model definition: `params` are trained, `frozen` (the base weights under
    LoRA adapters; empty otherwise) only read. Either may be abstract (shapes and axes only). `cfg.remat` must be
    a policy (`choose_remat` resolves "auto")."""
    if cfg.remat == "auto":
        raise ValueError("make_steps: trainer.remat = 'auto' must be resolved first (choose_remat)")
    frozen = nnx.State({}) if frozen is None else frozen
    if mesh is None:
        p_sh = f_sh = o_sh = b_sh = r_sh = None
    else:
        shard = LogicalSharding(mesh, tuple(rules))
        p_sh, f_sh = tree_shardings(params, shard), tree_shardings(frozen, shard)
        o_sh = _opt_shardings(tx, params, p_sh, mesh)
        b_sh = shard.named(("batch", "length"), (cfg.micro_rows, cfg.max_tokens))
        r_sh = NamedSharding(mesh, PartitionSpec())
    # Explicit in/out shardings on a mesh (gradient accumulators are fp32 and laid out like the params).
    def jit(f, in_shardings, out_shardings, **kw):
        if mesh is None:
            return jax.jit(f, **kw)
        return jax.jit(f, in_shardings=in_shardings, out_shardings=out_shardings, **kw)

    dtype = COMPUTE_DTYPES[cfg.compute_dtype]
    act_shard = None if mesh is None else LogicalSharding(mesh, tuple(rules))
    shards = batch_shards(b_sh)

    def forward(params, frozen, mb, size, routing: bool = False):
        """Per-token logprob of the targets and entropy at the loss positions (0 elsewhere), [R, T] fp32 (and, with
        `routing`, the MoE's Routing)."""
        if dtype is not None:  # bf16 compute: the cast is differentiated, so gradients reach the fp32 params
            params, frozen = jax.tree.map(lambda p: p.astype(dtype), (params, frozen))
        model = nnx.merge(graphdef, params, frozen)
        routes = mb.get("routes") if cfg.router_replay else None
        hidden, _, *routed = model.hidden(mb["tokens"], mb["positions"], mb["segment_ids"], attention=cfg.attention,
                                          scan=cfg.scan_layers, remat=cfg.remat, routes=routes, with_routes=routing,
                                          ends=mb["ends"] if shares_prefixes(cfg) else None)
        return *loss_logprobs(hidden, model.head(), mb["targets"], mb["temperature"], mb["loss_mask"], size,
                              cfg.logits_chunk, shards, act_shard), *routed

    def logprobs(params, frozen, mb, size=None):
        return forward(params, frozen, mb, size)[0]

    def loss(params, frozen, mb, prox, ref, scalars, size):
        model_cfg = nnx.merge(graphdef, params, frozen).cfg  # (at trace time)
        aux_coef = model_cfg.router_aux_loss_coef if model_cfg.num_experts and cfg.supervised else 0.0
        routing = bool(aux_coef) or "routes" in mb
        logp, entropy, *routed = forward(params, frozen, mb, size, routing)
        mask = mb["loss_mask"]
        if cfg.supervised:
            nll = jnp.where(mask, -logp, 0.0)
            value = jnp.sum(nll) / scalars["n_tokens"]
            metrics = {"tokens": jnp.sum(mask.astype(jnp.float32)), "nll_sum": jnp.sum(nll)}
            if aux_coef:  # the router's load balance, a token-weighted mean over the minibatch's micro-batches
                aux = load_balancing_loss(routed[0].logits, model_cfg.num_experts_per_tok, mb["segment_ids"] > 0)
                aux = aux * metrics["tokens"] / scalars["n_tokens"]
                value = value + aux_coef * aux
                metrics["aux_loss_sum"] = aux
        else:
            prox = jax.lax.stop_gradient(logp) if prox is None else prox  # one minibatch: π_prox = π_θ now
            value, metrics = ppo_loss(logp, prox, mb["behav_logp"], mb["advantages"], mask, cfg.ppo,
                                      scalars["n_tokens"], seq_ids=mb["sequences"], ref_logp=ref,
                                      minibatch_stat=scalars["minibatch_stat"], lag=scalars["version"] - mb["versions"])
        metrics["entropy_sum"] = jnp.sum(jnp.where(mask, jax.lax.stop_gradient(entropy), 0.0))
        if "routes" in mb:  # of the positions with recorded routes: the share of experts the router would not pick
            metrics.update(disagreement(jax.lax.stop_gradient(routed[0].logits), mb["routes"],
                                        model_cfg.num_experts_per_tok))
        metrics["loss"] = value
        return value, metrics

    def grad(params, frozen, acc, mb, prox, ref, scalars, size=None):
        g, metrics = jax.grad(loss, has_aux=True)(params, frozen, mb, prox, ref, scalars, size)
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g), metrics

    def apply(params, opt_state, grads, loss_value):
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss_value)
        grads = jax.tree.map(lambda g, p: jnp.where(ok, g, 0.0).astype(p.dtype), grads, params)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_state, opt_state), grad_norm, ok

    minibatch = cfg.ppo.spec.minibatch
    return Steps(
        copy=jit(lambda p: jax.tree.map(jnp.copy, p), (p_sh,), p_sh), init=jit(tx.init, (p_sh,), o_sh),
        zeros=jit(lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p), (p_sh,), p_sh),
        logprobs=jit(logprobs, (p_sh, f_sh, b_sh), b_sh, static_argnums=3),
        grad=jit(grad, (p_sh, f_sh, p_sh, b_sh, b_sh, b_sh, r_sh), (p_sh, r_sh), donate_argnums=2, static_argnums=7),
        minibatch_stat=None if minibatch is None else jax.jit(
            lambda prox, behav, mask: minibatch(jnp.concatenate([p - b for p, b in zip(prox, behav)]),
                                                jnp.concatenate(mask), cfg.ppo),
            **({} if mesh is None else {"out_shardings": r_sh})),
        apply=jit(apply, (p_sh, o_sh, p_sh, r_sh), (p_sh, o_sh, r_sh, r_sh), donate_argnums=(0, 1)),
        p_sh=p_sh, f_sh=f_sh, o_sh=o_sh, b_sh=b_sh, shards=shards)


def _opt_shardings(tx: optax.GradientTransformation, params: nnx.State, p_sh: Any, mesh: jax.sharding.Mesh) -> Any:
    """Optimizer-state shardings: subtrees shaped like the params (moments) follow the params; the rest
    (step counts) is replicated."""
    abstract = jax.eval_shape(tx.init, params)
    structure = jax.tree.structure(params)
    replicated = NamedSharding(mesh, PartitionSpec())
    is_params = lambda x: jax.tree.structure(x) == structure  # noqa: E731
    return jax.tree.map(lambda x: p_sh if is_params(x) else replicated, abstract, is_leaf=is_params)


def _abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s arrays, carrying `shardings` (a like-shaped tree, or None)."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _per_device(tree: Any, shardings: Any) -> int:
    """Bytes of `tree` one device holds (all of it without shardings)."""
    leaves = jax.tree.leaves(tree)
    shapes = ([x.shape for x in leaves] if shardings is None else
              [s.shard_shape(x.shape) for x, s in zip(leaves, jax.tree.leaves(shardings))])
    return sum(int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize for shape, x in zip(shapes, leaves))


def grad_step_bytes(graphdef: nnx.GraphDef, params: nnx.State, cfg: TrainerConfig, tx: optax.GradientTransformation,
                    mesh: jax.sharding.Mesh | None = None, rules: Rules = DEFAULT_RULES,
                    frozen: nnx.State | None = None, routes: tuple[int, int] | None = None) -> tuple[int, int]:
    """Per-device bytes of the train step as the compiler lays it out: (at its peak, its temporaries). The peak is
    the gradient program of one full micro-batch [micro_rows, max_tokens], every position scored (arguments +
    outputs − donated + temporaries), plus the optimizer state that stays resident meanwhile; the temporaries are
    one allocation of the device's allocator. Compiles, allocates nothing. `routes`: (layers, k) of a mixture of
    experts' replayed routes."""
    frozen = nnx.State({}) if frozen is None else frozen
    steps = make_steps(graphdef, params, cfg, tx, mesh, rules, frozen)
    shape = (cfg.micro_rows, cfg.max_tokens)
    batch = lambda dtype, *extra: jax.ShapeDtypeStruct((*shape, *extra), dtype, sharding=steps.b_sh)  # noqa: E731
    mb = {f: batch(bool if f == "loss_mask" else jnp.float32 if f in FLOATS else jnp.int32) for f in FIELDS}
    if routes:
        mb["routes"] = batch(jnp.int16, *routes)
    kl = not cfg.supervised and cfg.ppo.kl_coef
    scalars = jax.tree.map(lambda x: jax.ShapeDtypeStruct((), x.dtype), scalar_args(1))
    acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
    compiled = steps.grad.lower(_abstract(params, steps.p_sh), _abstract(frozen, steps.f_sh),
                                _abstract(acc, steps.p_sh), mb, batch(jnp.float32), batch(jnp.float32) if kl else None,
                                scalars).compile()
    m = compiled.memory_analysis()
    program = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return int(program) + _per_device(jax.eval_shape(tx.init, params), steps.o_sh), int(m.temp_size_in_bytes)


def choose_remat(need: Callable[[str], tuple[int, int]], limit: tuple[int, int] | None) -> str:
    """trainer.remat = "auto": the first policy of REMAT_AUTO (least recomputation first) whose train step's bytes
    per device (`need(policy)`: `grad_step_bytes`, (peak, temporaries)) fit `limit` (`memory_budget`: (free,
    largest free block)), each at most (1 − REMAT_MARGIN) of its limit; none fits: the last (the least memory).
    `limit` None (no memory statistics, e.g. CPU): REMAT_DEFAULT, `need` never called. Logs the choice."""
    if limit is None:
        logging.info("trainer.remat = auto: %s (no device memory statistics)", REMAT_DEFAULT)
        return REMAT_DEFAULT
    needs = {}
    for name in REMAT_AUTO:
        needs[name] = need(name)
        if all(n <= (1 - REMAT_MARGIN) * free for n, free in zip(needs[name], limit)):
            break
    gib = ", ".join(f"{k} {v[0] / 2**30:.2f} (temporaries {v[1] / 2**30:.2f})" for k, v in needs.items())
    logging.info("trainer.remat = auto: %s (train step GiB per device: %s; %.2f GiB free, largest free block %.2f GiB, "
                 "%.0f%% margin)", name, gib, limit[0] / 2**30, limit[1] / 2**30, 100 * REMAT_MARGIN)
    return name


def memory_budget(device: jax.Device) -> tuple[int, int] | None:
    """(bytes `device` can still allocate, the largest of them in one allocation): its allocator's limit less what
    is in use now (what is allocated later, such as a colocated generator's KV pages, is not known), and its largest
    free block where it reports one (a GPU's BFC allocator: an H200 with 94 GiB free gave at most 32 GiB at once);
    None where it reports no memory statistics (CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return free, min(free, int(stats.get("largest_free_block_bytes", free)))


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
