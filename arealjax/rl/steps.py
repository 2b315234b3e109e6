"""The trainer's device functions (`make_steps`: copy, init, logprobs, grad, the minibatch statistic, apply),
jitted with explicit shardings on the trainer mesh, and what they need of the device's memory (`grad_step_bytes`,
which `choose_remat` weighs against `memory_budget` for trainer.remat = "auto"). The head scores the loss
positions only, a chunk of logits at a time (`loss_logprobs`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from arealjax.models import attention as attn
from arealjax.models.transformer import HIDDEN_AXES, load_balancing_loss
from arealjax.rl.losses import ppo_loss
from arealjax.rl.packing import FIELDS, FLOATS
from arealjax.sharding import DEFAULT_RULES, LogicalSharding, Rules, constrain, tree_shardings

if TYPE_CHECKING:
    from arealjax.rl.trainer import TrainerConfig

COMPUTE_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}  # None: compute in the params' dtype
# trainer.remat = "auto": the first of these whose gradient program fits the device's free memory and whose
# temporaries (one allocation) fit its allocator's largest free block, each less a margin (what the compiler's
# estimate leaves out); none fits: the last. No memory statistics (CPU): REMAT_DEFAULT.
REMAT_AUTO = ("none", "save_dots", "full")
REMAT_MARGIN = 0.1
REMAT_DEFAULT = "none"


def shares_prefixes(cfg: TrainerConfig) -> bool:
    """Whether the trainer packs trees of shared prefixes: asked for, packed, and an attention kind that reads them."""
    return cfg.share_prefixes and cfg.packing and attn.pick(cfg.attention) in attn.TREES


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
