"""The redesign keeps the science: every mixer's quickstart loss curve and diagnostic metrics, on
one device and on 8 simulated devices, equal what they were before it (tests/parity.py recorded
them into tests/data/parity_before_redesign.json), within a tolerance per quantity measured across
XLA's CPU code paths for other instruction sets (tests/data/parity_tolerance.json, made by
``python tests/parity.py --spread``), so the record holds on another CPU."""

import json

import parity
import pytest

GOLD = json.loads(parity.GOLD.read_text())
RTOL = json.loads(parity.TOLERANCE.read_text())["rtol"]


def test_the_record_covers_every_registered_mixer_on_both_meshes():
  from mhc_jax import mixers

  assert sorted(parity.MIXERS) == sorted(mixers.names())
  assert sorted(GOLD) == sorted(f"{m}@{d}" for m in parity.MIXERS for d in parity.DEVICES)


def test_every_recorded_quantity_has_a_measured_tolerance_no_looser_than_one_percent():
  quantities = {parity.quantity(k) for series in GOLD.values() for k in series}
  assert quantities == set(RTOL)
  assert all(parity.FLOOR <= t <= 1e-2 for t in RTOL.values()), RTOL
  assert RTOL["loss"] <= 1e-4  # the loss curve itself stays tight


def test_tolerances_take_the_largest_rtol_needed_over_code_paths_times_the_safety_factor():
  gold = {"a@1": {"0/loss": [2.0], "2/gain_bwd": [1.0, 4.0], "2/err": [3e-7]}}
  paths = [
    {"a@1": {"0/loss": [2.0], "2/gain_bwd": [1.0 + 3e-5, 4.0], "2/err": [1e-7]}},
    {"a@1": {"0/loss": [2.0 + 2e-6], "2/gain_bwd": [1.0, 4.0 - 4.1e-4], "2/err": [0.0]}},
  ]
  tol = parity.tolerances(paths, gold)
  assert tol["gain_bwd"] == pytest.approx(parity.SAFETY * 1e-4)  # (4.1e-4 - atol) / 4
  assert tol["loss"] == parity.FLOOR  # within atol: no rtol needed
  assert tol["err"] == parity.FLOOR  # float32 noise around 0 stays inside atol
  assert parity.needed_rtol([1.0], [0.0]) == float("inf")


def test_the_tolerance_file_is_recomputed_from_the_committed_code_path_records():
  spread = parity.read_spread()
  assert sorted(spread) == sorted(parity.ISAS)
  assert parity.tolerances(list(spread.values()), GOLD) == RTOL


def _compare(case, got):
  gold = GOLD[case]
  missing = sorted(set(gold) - set(got))
  assert not missing, f"metric names gone: map them in tests/parity.py: {missing[:5]}"
  return [
    key
    for key, want in gold.items()
    if parity.needed_rtol(got[key], want) > RTOL[parity.quantity(key)]
  ]


#: The 8-device case trains with diagnostics at every step: the record's steps 1 and 3 come from
#: the diagnostic program, so the non-diagnostic one (whose compile is a third of a case's time)
#: is compiled for the 1-device case only, where it is held to the record.
SHARDED = ("train.diag_every=1",)


@pytest.mark.parametrize("case", sorted(GOLD))
def test_loss_curve_and_diagnostics_equal_the_record(case):
  mixer, devices = case.split("@")
  got = parity.record(mixer, int(devices), *(SHARDED if devices == "8" else ()))
  assert any(k.endswith("/loss") for k in got) and any(k.startswith("2/") for k in got)
  bad = _compare(case, got)
  assert not bad, [(k, got[k], GOLD[case][k]) for k in bad[:5]]


@pytest.mark.parametrize(
  "change, caught_in",
  [
    ("optim.lr=3.03e-3", "/loss"),
    ("model.mixer_options.res_diag=0.998", "/amax_bwd_composite_tok"),
  ],
)
def test_the_tolerances_still_catch_a_change_of_the_science(change, caught_in):
  """A 1% larger learning rate moves the loss curve, and H_res starting at diagonal 0.998
  instead of 0.999 the composite gains, past the measured tolerances (one Sinkhorn iteration
  fewer, 19 instead of 20, changes nothing at that init beyond update_rms_lr's band)."""
  bad = _compare("mhc@1", parity.record("mhc", 1, change))
  assert any(caught_in in k for k in bad), bad
