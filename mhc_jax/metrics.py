"""The metric registry: one entry per key a run writes to ``metrics.jsonl`` and ``summary.json``.

What each field of :class:`Metric` means: docs/interfaces.md, "Metric names in metrics.jsonl"
(generated from this table). The report, the notebooks and the docs read it; a new metric is an
entry here, not report code. No jax import: it is read without a training stack.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

#: How a report column reduces a metric over training (per-layer metrics: the whole-depth value,
#: i.e. the last entry of each list, unless the reduction says otherwise).
REDUCTIONS = {
  "first": "first logged value",
  "last": "last logged value",
  "final": "mean of the last 5% of logged values (ceil(n/20), at least 1); NaN/inf if any is",
  "min": "minimum over steps (non-finite values ignored)",
  "max": "maximum over steps (NaN ignored, inf kept)",
  "max_after_warmup": "maximum over the steps >= optim.warmup_steps (NaN ignored, inf kept)",
  "max_all_layers": "maximum over every layer and step",
  "absmax": "maximum over steps of |value|",
  "last_layer": "at the last diagnostics step, the last layer's value",
  "layer_mean": "at the last diagnostics step, the mean over layers",
  "layer_min": "at the last diagnostics step, the minimum over layers",
}


@dataclasses.dataclass(frozen=True)
class Metric:
  name: str
  shape: str  # scalar | layer | block | position
  when: str  # step | diag | eval | summary
  meaning: str
  log: bool = False
  summary: Mapping[str, str] = dataclasses.field(default_factory=dict)  # column -> reduction
  plot: str | None = None  # curve (against step) | depth (column against depth) | layer | heatmap


def _m(name, shape, when, meaning, log=False, summary=None, plot=None) -> Metric:
  return Metric(name, shape, when, meaning, log, dict(summary or {}), plot)


def _step(name, meaning, **kw) -> Metric:  # a scalar logged every step
  return _m(name, "scalar", "step", meaning, **kw)


def _diag(name, shape, meaning, **kw) -> Metric:  # logged every train.diag_every steps
  return _m(name, shape, "diag", meaning, **kw)


def _eval(name, meaning, shape="scalar", **kw) -> Metric:  # every train.eval_every steps
  return _m(name, shape, "eval", meaning, **kw)


_GAIN = "Amax gain (max |row sum| fwd, max |column sum| bwd)"
METRICS: tuple[Metric, ...] = (
  # ----------------------------------------------------------------- every logged step
  _step(
    "loss",
    "training loss, nats per token",
    summary={"loss_init": "first", "final_loss": "final", "min_loss": "min"},
    plot="curve",
  ),
  _step("z_loss", "mean squared log partition function (the z-loss term)"),
  _step("lr", "learning rate at this step"),
  _step(
    "grad_norm",
    "global gradient L2 norm before clipping",
    log=True,
    summary={"max_grad_norm": "max_after_warmup"},
    plot="curve",
  ),
  _step("grad_norm_clipped", "global gradient norm after clipping"),
  _step("param_norm", "global parameter L2 norm"),
  _step("update_rms_lr", "RMS of the parameter update divided by the lr"),
  _step("tokens_per_s", "training throughput, tokens per second"),
  _step("step_time_s", "wall time of the step, seconds"),
  _step("nonfinite", "running count of skipped non-finite steps"),
  _step(
    "spike_score",
    "fraction of spike steps in the trailing window (mhc_jax/spikes.py)",
    summary={"spike_score": "last"},
  ),
  # ----------------------------------------------------------------- every diag_every steps
  _diag("gain_fwd", "layer", "RMS(stream out) / RMS(stream in) of each layer", plot="heatmap"),
  _diag("branch_ratio", "layer", "RMS(sublayer output F) / RMS(stream in)"),
  _diag("grad_rms", "layer", "RMS of dLoss/d(stream entering the layer)"),
  _diag("gain_bwd", "layer", "factor by which the layer scales the gradient passing back"),
  _diag("amax_fwd", "layer", "forward Amax gain of the layer's own token-averaged H_res"),
  _diag("amax_bwd", "layer", "backward Amax gain of the layer's own token-averaged H_res"),
  *(
    _diag(
      f"amax_{d}_composite",
      "layer",
      f"{word} {_GAIN} of the prefix product of the token-averaged H_res (what the mHC paper "
      "plots); the last entry is the whole depth",
      log=True,
      summary={
        f"amax_{d}_composite_max": "max",
        f"amax_{d}_composite_max_all_layers": "max_all_layers",
      },
      plot="depth",
    )
    for d, word in (("fwd", "forward"), ("bwd", "backward"))
  ),
  *(
    _diag(
      f"amax_{d}_composite_tok_{k}",
      "layer",
      f"{word} Amax gain of each sampled token's own prefix product of its H_res, {how} over the "
      "token sample (token averaging can hide it)",
      log=True,
      summary={f"amax_{d}_composite_tok_{k}_max": "max"},
      plot="depth" if k == "mean" else None,
    )
    for d, word in (("fwd", "forward"), ("bwd", "backward"))
    for k, how in (("mean", "averaged"), ("max", "worst"))
  ),
  *(
    _diag(
      f"amin_{d}_composite",
      "layer",
      f"min |{side} sum| of the prefix product of H_res (below 1 the residual path attenuates)",
      log=True,
      summary={f"amin_{d}_composite_min": "min"},
    )
    for d, side in (("fwd", "row"), ("bwd", "column"))
  ),
  *(
    _diag(
      f"amax_{d}_suffix",
      "layer",
      f"{word} Amax gain of the suffix product of H_res, layer l to the output (mHC Eq. 4)",
      log=True,
      summary={f"amax_{d}_suffix_max_all_layers": "max_all_layers"},
    )
    for d, word in (("fwd", "forward"), ("bwd", "backward"))
  ),
  _diag("log_colsum_max", "layer", "max |log column sum| of the prefix product of H_res"),
  _diag("sinkhorn_err", "layer", "max column-sum error of the Sinkhorn projection"),
  _diag(
    "stream_spread",
    "layer",
    "RMS(x - mean over streams) / RMS(x) after each layer: 0 = streams collapsed into one",
    log=True,
    summary={
      "stream_spread_last": "last_layer",
      "stream_spread_mean": "layer_mean",
      "stream_spread_min": "layer_min",
    },
    plot="layer",
  ),
  _diag(
    "h_res_diag",
    "layer",
    "mean diagonal of the layer's token-averaged H_res: 1 = no mixing (I), 1/n = uniform (J/n)",
    summary={"h_res_diag_mean": "layer_mean", "h_res_diag_min": "layer_min"},
    plot="layer",
  ),
  _diag(
    "h_res_shift",
    "layer",
    "RMS over the n x n entries of the token-averaged H_res minus its value at step 0",
    summary={"h_res_shift_mean": "layer_mean", "h_res_shift_max_all_layers": "max_all_layers"},
    plot="layer",
  ),
  _diag(
    "h_res_dynamic_share",
    "layer",
    "token-dependent share of H_res over the token sample: sum_s |H_s - mean H|^2 / "
    "sum_s |H_s - J/n|^2 (0 = static)",
    summary={"h_res_dynamic_share_mean": "layer_mean"},
  ),
  _diag(
    "attn_logit_max",
    "block",
    "largest pre-softmax attention logit per attention layer",
    summary={"attn_logit_max": "max_all_layers"},
  ),
  _diag("layer_grad_norm", "block", "gradient L2 norm of each block's parameters"),
  _diag("update_ratio", "block", "RMS(update) / RMS(params before it) per block", log=True),
  _diag("out_logit_max", "scalar", "largest output logit", summary={"out_logit_max": "max"}),
  _diag(
    "logsumexp_mean",
    "scalar",
    "mean log partition function of the output softmax (z-loss pulls it to 0)",
    summary={"logz_absmax": "absmax"},
  ),
  _diag("logsumexp_max", "scalar", "max log partition function of the output softmax"),
  _diag(
    "growth_exponent",
    "scalar",
    "(1/(2L)) ln(RMS(x leaving layer 2L-1) / RMS(x entering layer 0)), activations",
    summary={"growth_exponent": "last"},
  ),
  _diag("growth_exponent_grad", "scalar", "the same for gradients, output back to input"),
  # ----------------------------------------------------------------- every eval_every steps
  _eval(
    "eval/loss",
    "held-out loss on data.eval_batches validation batches: the primary endpoint",
    summary={"eval_loss": "last"},
  ),
  _eval(
    "eval/kl_bits",
    "KL(exact posterior || model), bits per position (wind tunnels)",
    summary={"kl_bits": "last"},
    plot="curve",
  ),
  _eval("eval/entropy_gap_bits", "model entropy minus posterior entropy, bits"),
  _eval("eval/accuracy", "argmax agreement with the posterior's mode"),
  _eval("eval/ece", "expected calibration error"),
  _eval("eval/kl_bits_by_pos", "eval/kl_bits per position", shape="position"),
  _eval("eval/kl_bits_by_evidence", "eval/kl_bits by evidence seen (bijection)", shape="position"),
)

#: summary.json (written once, at the end of a run): field -> meaning.
SUMMARY_FIELDS = {
  "status": "done | diverged | halted | preempted | failed",
  "message": "why the run stopped, where it did not finish as planned",
  "steps": "steps trained",
  "final_loss": "last logged training loss (the report's final_loss is the mean of the last 5%)",
  "wall_s": "wall time, seconds, over every resume",
  "params": "parameter counts",
  "nonfinite": "non-finite steps skipped",
  "spikes": "steps with a loss or gradient spike",
  "divergence": '{"step", "reason"} where the divergence rule fired, else null',
  "first_nonfinite": '{"step", "layer", "tensor"} of the first non-finite step, else null',
  "eval/*": "the last evaluation's scalar metrics",
}


def by_name() -> dict[str, Metric]:
  return {m.name: m for m in METRICS}


def log_columns() -> frozenset[str]:
  """The report columns summarised on the log scale (those of the ``log`` metrics)."""
  return frozenset(c for m in METRICS if m.log for c in m.summary)


def markdown_table() -> str:
  """The registry as the Markdown table docs/interfaces.md carries (tests/test_metrics.py checks
  it is up to date)."""
  rows = ["| name | shape | logged | report columns (reduction) | log | plot | meaning |"]
  rows.append("| --- | --- | --- | --- | --- | --- | --- |")
  for m in METRICS:
    cols = ", ".join(f"`{c}` ({r})" for c, r in m.summary.items())
    log = "yes" if m.log else ""
    rows.append(
      f"| `{m.name}` | {m.shape} | {m.when} | {cols} | {log} | {m.plot or ''} | {m.meaning} |"
    )
  return "\n".join(rows) + "\n"
