"""The redesign keeps the science: every mixer's quickstart loss curve and diagnostic metrics, on
one device and on 8 simulated devices, equal (1e-5) what they were before it (tests/parity.py
recorded them into tests/data/parity_before_redesign.json)."""

import json

import numpy as np
import parity
import pytest

GOLD = json.loads(parity.GOLD.read_text())


def test_the_record_covers_every_registered_mixer_on_both_meshes():
  from mhc_jax import mixers

  assert sorted(parity.MIXERS) == sorted(mixers.names())
  assert sorted(GOLD) == sorted(f"{m}@{d}" for m in parity.MIXERS for d in parity.DEVICES)


@pytest.mark.parametrize("case", sorted(GOLD))
def test_loss_curve_and_diagnostics_equal_the_record(case):
  mixer, devices = case.split("@")
  got = parity.record(mixer, int(devices))
  gold = GOLD[case]
  assert sorted(got) == sorted(gold), "metric names changed: map them in tests/parity.py"
  assert any(k.endswith("/loss") for k in gold) and any(k.startswith("2/") for k in gold)
  for key, want in gold.items():
    np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-5, err_msg=f"{case} {key}")
