"""Orbax checkpoints of the train state plus host-side state (data position, spike monitor)."""
from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


class Checkpoints:
  """``CheckpointManager`` over ``run_dir/checkpoints``: keep the last k, save asynchronously."""

  def __init__(self, directory: str | Path, keep: int = 2, async_save: bool = True):
    self.dir = Path(directory).absolute()
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                        enable_async_checkpointing=async_save)
    self.mngr = ocp.CheckpointManager(self.dir, options=opts,
                                      item_names=("state", "host"))

  def latest(self) -> int | None:
    return self.mngr.latest_step()

  def save(self, step: int, state, host: dict, force: bool = False) -> None:
    self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 host=ocp.args.JsonSave(host)), force=force)

  def restore(self, abstract_state, step: int | None = None):
    """(state, host dict) at ``step`` (default: the latest)."""
    step = self.latest() if step is None else step
    out = self.mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), host=ocp.args.JsonRestore()))
    return out["state"], out["host"]

  def wait(self) -> None:
    self.mngr.wait_until_finished()

  def close(self) -> None:
    self.mngr.wait_until_finished()
    self.mngr.close()
