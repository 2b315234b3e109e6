"""Checkpoints of the whole RL state with orbax, for runs that must survive preemption and continue exactly.

    ckpt = Checkpointer(workdir / "checkpoints", every_steps=10, every_seconds=0, max_to_keep=3)
    ckpt.maybe_save(step, trainer, meta)        # async where orbax allows; a step's save is atomic
    step, meta = ckpt.restore_latest(trainer)   # params + optimizer state into the trainer; meta as saved

A checkpoint holds, as sharded arrays (`state/`), the trainer's params and optimizer state (and the reference
policy when a KL penalty uses one) and, as JSON (`meta/`), the policy version and optimizer-step counters, the
prompt stream's position, the prompts admitted but not yet trained, the controller's counters and the metrics
step. There is no RNG state to keep: sampling keys derive from (the prompt's seed, sample, position), and a prompt's
seed from (run seed, prompt id, epoch), which the pending prompts carry. Prompts in flight or
queued at save time are *re-issued* on resume, in admission order, before the stream continues: their
trajectories are generated again (with η = 0, from the same weights and the same sampling keys, so identically),
and no prompt is trained twice or skipped. Orbax commits a step only once it is complete (a rename on local disk,
a commit marker on GCS), so a save that is interrupted never replaces the previous checkpoint; `latest_step()`
only sees complete ones.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from arealjax.rl.trainer import Trainer
from arealjax.validate import Problems, number


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The `checkpoint` section: where (`dir`, "" = workdir/checkpoints; gs:// works), when (every `every_steps`
    steps or `every_seconds` seconds, 0 = off), and how many are kept."""

    dir: str = ""
    every_steps: int = 20
    every_seconds: float = 0.0
    max_to_keep: int = 3


def check(config: Any, problems: Problems) -> None:
    """The checkpoint section (every_steps, every_seconds, max_to_keep), at start-up."""
    c = config.checkpoint
    problems.positive("checkpoint.max_to_keep")
    problems.positive("checkpoint.every_steps", minimum=0)
    problems.need(number(c.every_seconds) and c.every_seconds >= 0, "checkpoint.every_seconds", "seconds ≥ 0")


class Checkpointer:
    def __init__(self, directory: str | Path, *, every_steps: int = 0, every_seconds: float = 0.0,
                 max_to_keep: int = 3, async_save: bool = True, create: bool = True):
        """`every_steps` / `every_seconds`: save when either is due (0 = off); `save(force)` always saves.
        `create=False` (reading only, e.g. an export) refuses a directory that does not exist instead of making it."""
        if jax.process_count() > 1:  # multi-host: see _barriers_over_the_coordination_service
            _barriers_over_the_coordination_service()
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self._last = time.monotonic()
        directory = str(directory)
        if not create and "://" not in directory and not Path(directory).is_dir():
            raise FileNotFoundError(f"no checkpoints: {directory} does not exist")
        self.manager = ocp.CheckpointManager(
            directory if "://" in directory else Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                                 enable_async_checkpointing=async_save))

    @property
    def directory(self) -> str:
        """Where the checkpoints are (a path or a URL), as messages name it."""
        return str(self.manager.directory)

    def due(self, step: int) -> bool:
        return bool((self.every_steps and step % self.every_steps == 0) or
                    (self.every_seconds and time.monotonic() - self._last >= self.every_seconds))

    def maybe_save(self, step: int, trainer: Trainer, meta: dict[str, Any], force: bool = False) -> bool:
        if not (force or self.due(step)) or step in self.manager.all_steps():
            return False
        t0 = time.perf_counter()
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(trainer)),
                                                        meta=ocp.args.JsonSave(meta)))
        self._last = time.monotonic()
        logging.info("checkpoint %d: saving (%.2fs blocking)", step, time.perf_counter() - t0)
        return True

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, trainer: Trainer) -> tuple[int, dict[str, Any]] | None:
        """Loads the newest complete checkpoint into `trainer` (same shardings) and returns (step, meta)."""
        step = self.manager.latest_step()
        if step is None:
            return None
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(trainer))
        saved = ocp.StandardCheckpointer().metadata(epath.Path(self.directory) / str(step) / "state")
        mismatch = _mismatch(saved.item_metadata, target)
        if mismatch:
            raise ValueError(f"checkpoint {self.directory}/{step} does not fit this config's model: "
                             f"{mismatch}. Resume with the config the run was started with (model, model_path, "
                             f"trainer.ppo.kl_coef), or start a new workdir")
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                 meta=ocp.args.JsonRestore()))
        meta = out["meta"]
        trainer.params, trainer.opt_state = out["state"]["params"], out["state"]["opt_state"]
        if "ref_params" in out["state"]:
            trainer.ref_params = out["state"]["ref_params"]
        trainer.version = meta["version"]
        trainer.optimizer_steps, trainer.skipped_steps = meta["optimizer_steps"], meta["skipped_steps"]
        return step, meta

    def close(self) -> None:
        """Waits for a save in progress to complete."""
        self.manager.wait_until_finished()
        self.manager.close()


def _barriers_over_the_coordination_service() -> None:
    """Orbax's barriers between processes default to a collective over every device, run from its background
    commit thread; interleaved with the train step's collectives from the main thread in a different order on
    each process, that deadlocks (seen: two processes stuck in step 485 after the async save of step 480). Its
    barriers over the coordination service's key-value store touch no device."""
    from absl import flags

    flags.FLAGS["experimental_orbax_use_distributed_barrier"].value = True


def _state(trainer: Trainer) -> dict[str, Any]:
    """The arrays of a checkpoint: params, optimizer state and, with a KL penalty, the reference policy."""
    state = {"params": trainer.params, "opt_state": trainer.opt_state}
    if getattr(trainer, "ref_params", None) is not None:
        state["ref_params"] = trainer.ref_params
    return state


def _mismatch(saved: Any, target: Any) -> str:
    """The first difference between a checkpoint's array metadata and the arrays to restore into ('' if none)."""
    def flat(tree):  # paths as "params/layers/0/..." whatever the containers (dicts on disk, nnx.State here)
        return {jax.tree_util.keystr(p, simple=True, separator="/"): x
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

    flat_saved, flat_target = flat(saved), flat(target)
    for key in sorted(set(flat_saved) | set(flat_target), key=lambda k: (not k.startswith("params/"), k)):
        if key not in flat_saved:
            return f"it has no array {key}"
        if key not in flat_target:
            return f"it has an array {key} this model does not"
        if tuple(flat_saved[key].shape) != tuple(flat_target[key].shape):
            return f"{key} is {tuple(flat_saved[key].shape)} there, {tuple(flat_target[key].shape)} here"
    return ""
