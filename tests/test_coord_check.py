"""``mhc-jax coord-check``: the verdict rule on planted frames, growing against flat on planted
parametrisations (an init whose scale grows with width against the standard one; the standard
init against depth_scaled along depth), the CLI's files, and bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mhc_jax import cli, coord_check as cc
from mhc_jax.train.config import load_config

TINY = (
  *cc.FIXED,
  *("model.depth=1", "model.heads=2", "data.seq_len=8", "data.batch_size=4", "optim.lr=1e-3"),
)


def test_verdict_rule_on_planted_frames():
  """value = size^k: the fitted slope is k; growing above +SLOPE_TOL, shrinking below minus it."""
  rows = []
  for q, k in (("up", 1.0), ("level", 0.1), ("down", -0.5), ("nan", 0.0)):
    for size in (16, 32, 64):
      for layer, c in enumerate((1.0, 3.0)):
        v = np.nan if q == "nan" and size == 64 else c * size**k
        rows += [("width", size, 2, layer, q, s, v if s else 7.0) for s in (0, 2)]
  df = pd.DataFrame(rows, columns=["axis", "width", "depth", "layer", "quantity", "step", "value"])
  v = cc.verdicts(df).set_index("quantity")
  assert v.verdict.to_dict() == {
    "up": "growing",
    "level": "flat",
    "down": "shrinking",
    "nan": "undefined (non-finite or zero values)",
  }
  np.testing.assert_allclose(v.slope[["up", "level", "down"]], [1.0, 0.1, -0.5], atol=1e-9)


@pytest.mark.slow
def test_an_init_growing_with_width_grows_and_the_standard_init_stays_flat(tmp_path):
  """init_scale = width/16 (weights' std grows with width) against the standard LeCun init, at a
  small lr: the stream's RMS grows (slope ~2) against stays flat (~0.1). The standard init's
  activation *changes* grow with width under Adam at a fixed lr (slope ~1: muP's finding for the
  standard parametrisation)."""

  def cfg(scale):
    return lambda w, d: load_config(
      None, [*TINY, f"model.width={w}", f"model.init_scale={scale(w)}"]
    )

  widths = [16, 64]
  grows = cc.run(cfg(lambda w: w / 16), widths, [], 2, progress=False)
  flat = cc.run(cfg(lambda w: 1.0), widths, [], 2, progress=False)
  assert set(flat.width) == {16, 64} and set(flat.step) == {0, 1, 2}
  verdict = lambda df: cc.verdicts(df).set_index("quantity").verdict.to_dict()
  assert verdict(grows)["act_rms"] == "growing" and verdict(flat)["act_rms"] == "flat"
  assert verdict(flat)["act_delta_rms"] == "growing"
  # width 16 is the same model in both; at step 0 every change is zero
  at16 = lambda df: df[df.width == 16].set_index(["layer", "quantity", "step"]).value
  np.testing.assert_allclose(at16(grows), at16(flat))
  changes = flat[(flat.step == 0) & flat.quantity.str.contains("delta")]
  assert len(changes) and (changes.value == 0).all()
  # the attention's largest logit: finite, positive, and moved by training
  logit = flat[flat.quantity == "attn_logit_max"].set_index(["width", "step"]).value
  assert np.isfinite(logit).all() and (logit > 0).all() and logit[64, 2] != logit[64, 0]
  cc.plot(pd.concat([grows, flat.assign(axis="depth", depth=flat.width)]), tmp_path / "p.png")
  assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
def test_the_standard_init_grows_with_depth_and_depth_scaled_stays_flat():
  """A pre-norm residual stream's RMS grows as sqrt(depth) at the standard init (slope ~0.5) and
  stays flat with branches scaled by 1/sqrt(2L) (``model.init=depth_scaled``, ~0.1)."""

  def cfg(init):
    return lambda w, d: load_config(
      None, [*TINY, "model.width=16", f"model.depth={d}", f"model.init={init}"]
    )

  grows = cc.run(cfg("standard"), [], [1, 4], 2, progress=False)
  flat = cc.run(cfg("depth_scaled"), [], [1, 4], 2, progress=False)
  assert set(grows.depth) == {1, 4} and set(grows[grows.depth == 4].layer) == {0, 1, 2, 3}
  verdict = lambda df: cc.verdicts(df).set_index("quantity").verdict.to_dict()
  assert verdict(grows)["act_rms"] == "growing" and verdict(flat)["act_rms"] == "flat"


@pytest.mark.slow
def test_cli_writes_the_csv_and_plot_and_prints_verdicts(tmp_path, capsys, monkeypatch):
  out, measured, measure = tmp_path / "cc", [], cc.measure
  monkeypatch.setattr(cc, "measure", lambda s, n: measured.append(s.cfg.model) or measure(s, n))
  sets = ["model.depth=1", "model.width=16", "model.heads=2", "data.seq_len=8", "data.batch_size=4"]
  argv = ["coord-check", "residual", "--set", *sets, "--widths", "16,32", "--depths", "1,2"]
  argv += ["--parametrization", "mup", "--set", "model.base_width=8"]
  assert cli.main([*argv, "--steps", "1", "--out", str(out), "--quiet"]) == 0
  lines = capsys.readouterr().out.splitlines()
  # the base: the smallest depth checked, the width --set gave (docs/parametrization.md)
  assert lines[0] == "residual under mup (base width 8, depth 1)"
  # the chosen parametrisation's verdicts, then sp's beside them (tagged)
  assert sum(" against width: " in ln and "[sp]" not in ln for ln in lines) == 4
  assert sum(" against depth: " in ln and "[sp]" not in ln for ln in lines) == 4
  assert sum(ln.endswith("[sp]") for ln in lines) == 8
  df = pd.read_csv(out / "coord_check.csv")
  cols = ["parametrization", "axis", "width", "depth", "layer", "quantity", "step", "value"]
  assert list(df.columns) == cols and list(df.parametrization.unique()) == ["mup", "sp"]
  # per parametrisation: quantities x steps 0, 1 x the blocks of widths 16, 32 (depth 1) and
  # depths 1, 2 (width 16)
  assert len(df) == 2 * 4 * 2 * (1 + 1 + 1 + 2) and np.isfinite(df.value).all()
  assert set(df[df.axis == "depth"].width) == {16} and set(df[df.axis == "width"].depth) == {1}
  assert sorted(p.name for p in out.iterdir()) == ["coord_check.csv", "coord_check.png"]
  # the base size (16, 1) sits on both axes: trained once per parametrisation, read twice
  assert sorted((m.parametrization, m.width, m.depth) for m in measured) == [
    (p, w, d) for p in ("mup", "sp") for w, d in ((16, 1), (16, 2), (32, 1))
  ]
  base = df[(df.width == 16) & (df.depth == 1)].set_index(["parametrization", "axis"]).value
  np.testing.assert_array_equal(base.xs("width", level=1), base.xs("depth", level=1))


@pytest.mark.parametrize(
  "args,message",
  [
    (["bogus"], "model.mixer: unknown mixer 'bogus'"),
    (["residual", "--widths", "16"], "--widths: expected two or more"),
    (["residual", "--depths", "2,x"], "--depths: expected two or more"),
    (["residual", "--widths", "0,16"], "--widths: expected two or more"),
    (["hc", "--set", "model.mixer_options.zz=1"], "model.mixer_options.zz: unknown key"),
    (["residual", "--set", "model.heads=3"], "model.heads: 3 does not divide"),
  ],
)
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, capsys, args, message):
  out = tmp_path / "cc"
  assert cli.main(["coord-check", *args, "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("error:") == 1 and message in err, err
  assert not out.exists()


def test_an_existing_out_dir_is_never_overwritten(tmp_path, capsys):
  (tmp_path / "keep").write_text("x")
  assert cli.main(["coord-check", "residual", "--out", str(tmp_path)]) == 2
  assert "exists" in capsys.readouterr().err and (tmp_path / "keep").read_text() == "x"
  assert [p.name for p in tmp_path.iterdir()] == ["keep"]
