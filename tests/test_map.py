"""``mhc-jax map MIXER`` (mhc_jax/sweep/design_map.py): its reference rows are the zoo map's, its
runs are the zoo map's runs for the same mixer, and end to end at toy size it trains a design and
prints and writes its row among the references; a mixer failing the contract, an unknown one
and a bad flag are refused before anything is written."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import pytest

from mhc_jax import cli
from mhc_jax.sweep import design_map, grid
from mhc_jax.train.config import read_yaml, to_dict

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "docs" / "studies" / "zoo_map"
TOY = ["--depths", "1,2", "--lrs", "0.01,1", "--seeds", "1"]
TOY += [
  "--set",
  "train.steps=4",
  "optim.warmup_steps=1",
  "train.eval_every=4",
  "train.diag_every=0",
]

NO_ROLES = """
import flax.linen as nn
from mhc_jax.mixers import Mixer
from mhc_jax.mixers.base import make_stats, param
import jax.numpy as jnp


class NoRoles(Mixer):
  '''x + a F(x) whose gate a has no parameter role (param_roles forgotten).'''

  def layer_params(self, width):
    return 1

  @nn.compact
  def __call__(self, x, sublayer, layer=0):
    a = param(self, "a", nn.initializers.constant(0.5), (), ())
    f = sublayer(x[..., 0, :])
    out = x + (a * f)[..., None, :].astype(x.dtype)
    return out, make_stats(x, out, f, jnp.eye(1), jnp.ones((1,)), a[None])
"""


def _args(mixer, **kw) -> argparse.Namespace:
  return cli.build_parser().parse_args(
    ["map", mixer, *sum(([f"--{k}", v] for k, v in kw.items()), [])]
  )


def test_reference_rows_are_the_zoo_maps():
  shipped = ROOT / "mhc_jax" / "sweep" / "reference" / "zoo_map_lr_sensitivity.csv"
  assert shipped.read_bytes() == (ZOO / "lr_sensitivity.csv").read_bytes()
  assert len(design_map.references()) == 54  # 18 arms x 3 depths
  # the families (which the zoo analysis reads from the map) hold every arm of the map once
  arms = [a for fam in design_map.FAMILIES.values() for a in fam]
  assert sorted(arms) == sorted(set(pd.read_csv(ZOO / "runs.csv")["arm"]))


def test_runs_are_the_zoo_maps_runs():
  mine = design_map.plan(_args("peri_ln")).sweep
  data = read_yaml(ROOT / "configs" / "studies" / "zoo_map.yaml", "zoo_map")
  data["axes"]["arm"] = {"peri_ln": data["axes"]["arm"]["peri_ln"]}  # one arm: 63 runs to check
  zoo = grid.read_sweep(None, data=data, variant="cpu")
  theirs = {r.name: r.cfg for r in zoo.runs}
  assert len(mine.runs) == len(theirs) == 63
  for r in mine.runs:
    a, b = to_dict(r.cfg), to_dict(theirs[r.name.replace("peri_ln_new", "peri_ln")])
    assert {**a, "name": ""} == {**b, "name": ""}, r.name


def test_sentence_from_the_zoo_rows():
  tab = design_map.references()
  text = design_map.sentence(
    tab[tab["arm"].isin(["frac", "residual", "mhc_identity"])], "frac", True
  )
  assert text.startswith("frac's largest working lr is >= 1 / 0.3 / 0.1 at depths 4 / 8 / 16")
  assert "from depth 4 to 16 its edge falls 2 steps" in text
  assert "it falls more than mhc_identity's by two steps or more" in text
  assert "a one-step difference (from residual)" in text
  assert "its edge at depth 4, above the grid's top" in text and "any comparison" not in text
  text = design_map.sentence(
    tab[tab["arm"].isin(["laurel", "residual", "post_ln"])], "laurel", True
  )
  assert "from depth 4 to 16 its edge ends with no working lr" in text
  assert "it falls more than residual's by two steps" in text and "post_ln's ends with" in text
  rows = design_map.table(tab).set_index("design")
  assert rows.loc["residual_qk", "largest working lr"] == ">= 1 / >= 1 / 0.1"
  assert rows.loc["residual_qk", "first failure"] == "- / - / 0.3 (no_training)"
  assert rows.loc["laurel", "largest working lr"] == "0.03 / none / none"


def test_map_end_to_end(tmp_path, monkeypatch, capsys):
  monkeypatch.syspath_prepend(str(ROOT / "examples" / "my_mixer"))
  out = tmp_path / "map"
  code = cli.main(["map", "my_mixer.rezero:ReZero", *TOY, "--out", str(out), "--quiet"])
  printed, err = capsys.readouterr()
  assert code == 0, err
  table = printed[printed.index("| design |") :]
  for arm in ("rezero", "residual", "mhc", "hc"):
    assert f"| {arm} |" in table
  assert "| rezero | 1 / 2 |" in table and "| residual | 4 / 8 / 16 | 0.03 / 0.03 / 0.03 |" in table
  assert (
    "rezero's largest working lr is" in printed
    and "any comparison: this grid or regime is not the zoo map's" in printed
  )
  tab = pd.read_csv(out / "lr_sensitivity.csv")
  assert list(dict.fromkeys(tab["arm"])) == ["rezero", "residual", "hc", "mhc"]
  assert tab[tab["arm"] == "rezero"]["depth"].tolist() == [1, 2]
  ref = design_map.references()
  pd.testing.assert_frame_equal(
    tab[tab["arm"] == "hc"].reset_index(drop=True), ref[ref["arm"] == "hc"].reset_index(drop=True)
  )
  runs = pd.read_csv(out / "runs.csv")
  assert len(runs) == 4 and set(runs["arm"]) == {"rezero"} and runs["eval_loss"].notna().all()
  assert (out / "edges.png").stat().st_size > 10_000


def test_a_mixer_failing_the_contract_is_refused(tmp_path, monkeypatch, capsys):
  (tmp_path / "broken_mix.py").write_text(NO_ROLES)
  monkeypatch.syspath_prepend(str(tmp_path))
  out = tmp_path / "map"
  assert cli.main(["map", "broken_mix:NoRoles", *TOY, "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: map: broken_mix:NoRoles: 1 of 6")
  assert "check_param_roles" in err[0] and "check_shapes" not in err[0]
  assert not out.exists()


@pytest.mark.parametrize(
  "argv,says",
  [
    (["no_such_mixer"], "unknown name 'no_such_mixer'"),
    (["hc", "--depths", "4,x"], "--depths: expected"),
    (["hc", "--reference", "residual,nope"], "--reference: nope not in the zoo map"),
    (["hc", "--set", "model.width=31"], "model.width"),
    (["hc", "--bogus"], "unrecognized arguments: --bogus"),
  ],
)
def test_bad_input_is_one_line(argv, says, tmp_path, capsys):
  out = tmp_path / "map"
  try:
    code = cli.main(["map", *argv, "--out", str(out)])
  except SystemExit as e:  # argparse's
    code = e.code
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and says in err[0], err
  assert not out.exists()


def test_dry_run_lists_the_runs(tmp_path, capsys):
  out = tmp_path / "map"
  assert cli.main(["map", "residual", *TOY, "--out", str(out), "--dry-run"]) == 0
  printed = capsys.readouterr().out
  assert "sweep map_residual_new: 4 runs" in printed
  assert "arm=residual_new,depth=2,lr=1,seed=0" in printed and "estimate: about" in printed
  assert not out.exists()
