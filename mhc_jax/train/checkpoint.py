"""Orbax checkpoints of the train state plus host-side state (spike monitor, divergence rule)."""

from __future__ import annotations

import functools
import os

import jax
import orbax.checkpoint as ocp

from mhc_jax import storage


@functools.cache
def _single_replica_saves_on_one_cpu_process() -> None:
  """Save each array shard from one replica when one CPU process holds every device (why:
  docs/interfaces.md, "Training engine"); needs orbax's internal default metadata store."""
  if jax.process_count() != 1 or jax.default_backend() != "cpu":
    return
  try:
    from orbax.checkpoint._src.metadata.array_metadata_store import Store
  except ImportError:
    return
  handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=Store())
  ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


class Checkpoints:
  """``CheckpointManager`` over ``run_dir/checkpoints`` (local or ``gs://``): keep the last k,
  save asynchronously."""

  def __init__(self, directory, keep: int | None = 2, async_save: bool = True):
    local = storage.is_local(directory)
    self.dir = storage.path(os.path.abspath(directory) if local else directory)
    _single_replica_saves_on_one_cpu_process()
    opts = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=async_save
    )
    self.mngr = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", "host"))

  def latest(self) -> int | None:
    return self.mngr.latest_step()

  def steps(self) -> list[int]:
    return sorted(self.mngr.all_steps())

  def save(self, step: int, state, host: dict, force: bool = False) -> None:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host))
    self.mngr.save(step, args=args, force=force)

  def restore(self, abstract_state, step: int | None = None):
    """(state, host dict) at ``step`` (default: the latest), straight into the shardings of
    ``abstract_state`` (ShapeDtypeStructs: nothing is allocated before the restore)."""
    step = self.latest() if step is None else step
    restore = ocp.args.StandardRestore(abstract_state)
    args = ocp.args.Composite(state=restore, host=ocp.args.JsonRestore())
    out = self.mngr.restore(step, args=args)
    return out["state"], out["host"]

  def prune_after(self, step: int) -> None:
    """Delete the checkpoints past ``step`` (left by an attempt that is being redone)."""
    for s in self.steps():
      if s > step:
        self.mngr.delete(s)

  def wait(self) -> None:
    self.mngr.wait_until_finished()

  def close(self) -> None:
    self.mngr.wait_until_finished()
    self.mngr.close()
