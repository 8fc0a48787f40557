"""Multi-process start-up and agreement: ``jax.distributed.initialize`` from the config, flags
or MHC_* environment; process 0's values broadcast to all; barriers; the SIGTERM step all
processes agree on. In a single process every function here is a cheap no-op."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np

from mhc_jax.errors import ConfigError


def init_distributed(cfg, args=None):
  """``cfg`` with its resolved ``dist``, after ``jax.distributed.initialize`` when the flags
  (``args.<key>``), the config or the MHC_* environment ask for several processes (in that
  order of precedence)."""
  from mhc_jax.train.config import resolve_dist

  dist = cfg.dist
  flags = {k: getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")}
  flags = {k: v for k, v in flags.items() if v is not None}
  if flags:
    dist = dataclasses.replace(dist, enabled=True, **flags)
  dist = resolve_dist(dist)
  if not dist.enabled:
    return cfg
  missing = [k for k in ("coordinator", "num_processes", "process_id") if getattr(dist, k) is None]
  if missing:
    raise ConfigError(f"dist.{missing[0]}: required for a multi-process run")
  import jax

  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(dist.coordinator, dist.num_processes, dist.process_id)
  return dataclasses.replace(cfg, dist=dist)


def is_main() -> bool:
  import jax

  return jax.process_index() == 0


def broadcast_str(text: str, size: int = 4096) -> str:
  """Process 0's ``text`` on every process (e.g. a default run directory, which holds the
  time of day, or process 0's verdict on a run directory)."""
  import jax

  if jax.process_count() == 1:
    return text
  from jax.experimental import multihost_utils

  raw = np.zeros(size, np.uint8)
  data = text.encode()[:size]
  raw[: len(data)] = np.frombuffer(data, np.uint8)
  raw = np.asarray(multihost_utils.broadcast_one_to_all(raw))
  return raw.tobytes().rstrip(b"\0").decode(errors="replace")


def sync(name: str) -> None:
  """A barrier across processes (no-op in one process)."""
  import jax

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def preemption_check():
  """``step -> bool``: the SIGTERM step all processes agree on (JAX's preemption service), so
  that they save the same checkpoint; None in one process or when the service is off."""
  import jax

  if jax.process_count() == 1 or not jax.config.jax_enable_preemption_service:
    return None
  from jax.experimental import multihost_utils

  return multihost_utils.reached_preemption_sync_point


def in_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()
