"""TensorBoard mirror of the metrics record: scalars and per-layer curves are readable back."""

import glob

from tensorboardX.event_file_writer import EventFileWriter  # noqa: F401  (extra installed)

from mhc_jax.tb import TBWriter


def _read_events(path):
  import struct

  from tensorboardX.proto import event_pb2

  out = []
  with open(path, "rb") as f:
    data = f.read()
  i = 0
  while i < len(data):
    (n,) = struct.unpack("<Q", data[i : i + 8])
    ev = event_pb2.Event()
    ev.ParseFromString(data[i + 12 : i + 12 + n])
    out.append(ev)
    i += 12 + n + 4
  return out


def test_scalars_and_layers_round_trip(tmp_path):
  w = TBWriter(tmp_path)
  w.write({"step": 3, "loss": 1.5, "gain_fwd": [1.0, 2.0], "flag": True, "bad": float("nan")})
  w.close()
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  tags = {
    (v.tag, round(v.simple_value, 6), e.step) for e in _read_events(path) for v in e.summary.value
  }
  assert tags == {("loss", 1.5, 3), ("gain_fwd/layer_00", 1.0, 3), ("gain_fwd/layer_01", 2.0, 3)}


def test_training_run_writes_event_files(tmp_path):
  import jax

  from mhc_jax.train.config import load_config
  from mhc_jax.train.loop import prepare, train

  cfg = load_config(
    "configs/debug.yaml", ["train.tensorboard=true", "train.steps=2", "optim.warmup_steps=0"]
  )
  train(prepare(cfg, devices=jax.devices()[:1]), tmp_path / "run", progress=False)
  (path,) = glob.glob(str(tmp_path / "run" / "tb" / "events.out.tfevents.*"))
  tags = {v.tag for e in _read_events(path) for v in e.summary.value}
  assert {"loss", "grad_norm", "lr"} <= tags
