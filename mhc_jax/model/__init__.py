"""The decoder Transformer with pluggable residual mixers."""

from mhc_jax.model.params import count_params, expected_params
from mhc_jax.model.transformer import (
  Transformer,
  loop_to_scan,
  make_mixer,
  probe_shape,
  scan_to_loop,
  state_shapes,
  zero_probes,
)

__all__ = ["Transformer", "count_params", "expected_params", "loop_to_scan", "make_mixer"]
__all__ += ["probe_shape", "scan_to_loop", "state_shapes", "zero_probes"]
