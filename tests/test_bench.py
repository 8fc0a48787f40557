"""benchmarks/step_bench.py and population_bench.py at toy size: bad input exits 2 before anything
runs, and an ``xla_`` override reaches the row's compiler (an unknown option fails that row
alone) while config overrides stay config overrides."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import population_bench  # noqa: E402
import step_bench  # noqa: E402
import step_compile  # noqa: E402
import step_dots  # noqa: E402
import step_profile  # noqa: E402
import stream_spread  # noqa: E402
import suite_times  # noqa: E402
import train_step  # noqa: E402

TOY = ["--width", "16", "--depth", "1", "--heads", "2", "--batch", "2", "--seq-len", "8"]
TOY += ["--matmul", "256x256x256"]  # the reference matmul at toy size too


def test_split_options_separates_xla_options_from_config_overrides():
  over, opts = step_bench.split_options(
    ["model.remat=full", "xla_cpu_prefer_vector_width=512", "xla_x=a=b", "xla_y=False", "xla_z=P:Q"]
  )
  assert over == ["model.remat=full"]
  assert opts == {
    "xla_cpu_prefer_vector_width": "512",
    "xla_x": "a=b",
    "xla_y": False,
    "xla_z": "P,Q",  # ':' separates a list value's items (',' separates the variants)
  }


@pytest.mark.parametrize(
  "argv, msg",
  [
    (["--variants", "scan,fast"], "error: --variants: unknown ['fast']"),
    (["--variants", "scan+model.remat=most"], "error: --set:"),
    (["--set", "model.width=-1"], "error: --set:"),
    (["--matmul", "256x256"], "error: --matmul: expected MxKxN"),
  ],
)
def test_step_bench_bad_input_exits_2(argv, msg, capsys):
  assert step_bench.main(TOY + argv) == 2
  assert msg in capsys.readouterr().err


def test_compile_time_eager_compiles_each_tiny_program_once():
  from jax import monitoring

  n = []

  def count(event, duration, **_):
    n.extend([duration] if event == "/jax/core/compile/backend_compile_duration" else [])

  monitoring.register_event_duration_secs_listener(count)
  try:
    wall, cpu = step_compile.eager_compiles(3)
  finally:
    monitoring.unregister_event_duration_listener(count)
  assert len(n) == 3 and 0 < sum(n) <= wall and cpu > 0  # three fresh compiles, timed within


def test_population_bench_bad_modes_exit_2(capsys):
  with pytest.raises(SystemExit) as e:
    population_bench.main(["--modes", "vmap,pmap"])
  assert e.value.code == 2
  assert "--modes: the one population mode is vmap" in capsys.readouterr().err


def test_step_bench_xla_option_rows(tmp_path, capsys):
  out = tmp_path / "rows.json"
  variants = "scan,scan+xla_cpu_prefer_vector_width=128,scan+xla_no_such_option=1"
  argv = TOY + ["--mixers", "residual", "--variants", variants, "--steps", "2", "--warmup", "1"]
  assert step_bench.main(argv + ["--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "No such compile option: 'xla_no_such_option'" in text  # the option reached XLA
  rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {"scan", "scan+xla_cpu_prefer_vector_width=128"}
  assert all(len(r["times"]) == 2 and min(r["times"]) > 0 for r in rows.values())
  assert "residual scan+xla_cpu_prefer_vector_width=128 / scan:" in text


@pytest.mark.parametrize(
  "place, part",
  [
    (
      "jvp(Transformer)/while/body/closed_call/blocks/attn_mix/attn_mix.project_res/closed_call/while/body/closed_call/reduce_sum",
      "Sinkhorn",
    ),
    (
      "transpose(jvp(Transformer))/while/body/closed_call/checkpoint/blocks/mlp_mix/mlp/up/dot_general",
      "attention and MLP",
    ),
    ("jvp(Transformer)/while/body/closed_call/blocks/attn_mix/attn_norm/mul", "attention and MLP"),
    (
      "transpose(jvp(Transformer))/while/body/closed_call/checkpoint/blocks/attn_mix/...ic,...jc->...ij/dot_general",
      "mixer",
    ),
    (
      "transpose(jvp(Transformer))/while/body/jit(dynamic_index_in_dim)/dynamic_slice",
      "scan stacking",
    ),
    (
      "jvp(Transformer)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice",
      "scan stacking",
    ),
    ("jvp(Transformer)/embedding/gather", "rest"),
  ],
)
def test_step_profile_parts(place, part):
  """step_profile's breakdown puts each op where its place in the model says it belongs."""
  assert step_profile.part_of(place).startswith(part)


def test_step_profile_finds_fusions_holding_a_dynamic_slice():
  import jax
  import jax.numpy as jnp

  stack = jnp.ones((4, 64, 64))
  at = jax.jit(lambda s, i: jnp.tanh(s[i]) * 2.0).lower(stack, jnp.int32(1)).compile()
  plain = jax.jit(lambda x: jnp.tanh(x) * 2.0).lower(stack[0]).compile()
  assert step_profile.sliced_fusions(at.as_text())
  assert not step_profile.sliced_fusions(plain.as_text())


def test_step_profile_op_times_and_parts(capsys):
  """op_times sums a program's compiled ops over profiled calls; print_parts sorts them into the
  model's parts (what step_profile and population_bench --parts print)."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((256, 256))
  f = jax.jit(lambda x: jnp.tanh(x @ x) * 2.0)
  hlo = f.lower(x).compile().as_text()
  total, calls, places = step_profile.op_times(lambda: jax.block_until_ready(f(x)), hlo, traced=2)
  assert total and all(ms > 0 for ms in total.values()) and set(total) <= set(places)
  assert all(calls[name] == 1 for name in total)  # each op once a call
  step_profile.print_parts(total, places)
  out = capsys.readouterr().out
  rest = [
    line for line in out.splitlines() if line.endswith("rest (embedding, head, loss, optimiser)")
  ]
  assert len(rest) == 1 and float(rest[0].split()[0]) == pytest.approx(
    sum(total.values()), abs=0.051
  )


def test_step_profile_place_diff(capsys):
  """by_place sums op time per place (loops left out); print_place_diff ranks places by growth
  (what step_profile --diag-diff prints)."""
  places = {"a": "jit(step)/x/add", "b": "jit(step)/x/add", "c": "jit(step)/y/mul", "while.1": "z"}
  off = step_profile.by_place({"a": 1.0, "b": 2.0, "c": 5.0, "while.1": 9.0}, places)
  on = step_profile.by_place({"a": 1.0, "b": 4.0, "c": 5.5, "while.1": 20.0}, places)
  assert off == {"x/add": 3.0, "y/mul": 5.0} and on == {"x/add": 5.0, "y/mul": 5.5}
  step_profile.print_place_diff(off, on, top=1)
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "op time a step: 8 ms off, 10 ms on"
  assert lines[-1].split() == ["2.00", "3.00", "5.00", "x/add"]


def test_suite_times_sums_the_workers_records(tmp_path, capsys):
  C, T = suite_times.COMPILE, suite_times.TRACE
  for w, (a, b) in {"gw0": (1.5, 0.25), "gw1": (2.0, 0.5)}.items():
    per = {f"tests/test_{w}.py::t": {C: a, T: b, "cpu_s": 4 * a}, "tests/test_x.py::u": {C: 0.5}}
    rec = {"cpu_s": 10.0, "total": {C: a + 0.5, T: b}, "count": {C: 3, T: 1}, "per_test": per}
    (tmp_path / f"{w}.json").write_text(json.dumps(rec))
  assert suite_times.main([str(tmp_path), "--top", "2"]) == 0
  out = capsys.readouterr().out
  assert "2 test process(es), 20.0 CPU s" in out
  assert f"    4.5       6  {C}" in out and f"    0.8       2  {T}" in out
  files = out.split("test file\n")[1].split("\n\n")[0].splitlines()
  assert files == [
    "    2.0     0.5     0.0  tests/test_gw1.py",
    "    1.5     0.2     0.0  tests/test_gw0.py",
  ]
  cpu = out.split("(with its subprocesses)\n")[1].splitlines()  # per test, CPU s first
  assert cpu == ["    8.0  tests/test_gw1.py::t", "    6.0  tests/test_gw0.py::t"]
  assert suite_times.main([str(tmp_path / "none")]) == 2
  assert "no per-process records" in capsys.readouterr().err


def test_hlo_dots_reads_every_dot_with_its_shapes():
  import jax
  import jax.numpy as jnp

  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  a, b = jnp.ones((4, 8, 16)), jnp.ones((4, 16, 8))
  f = jax.jit(lambda x, w, a, b: (jnp.tanh(x @ w).sum(), jnp.einsum("bij,bjk->bik", a, b) * 2))
  dots = step_dots.hlo_dots(f.lower(x, w, a, b).compile().as_text())
  assert sorted((d.flops, c) for d, c in dots.items()) == [
    (2 * 4 * 8 * 16 * 8, 1),
    (2 * 8 * 16 * 32, 1),
  ]
  batched = next(d for d in dots if d.lhs_batch)
  assert (batched.lhs, batched.rhs, batched.lhs_batch, batched.rhs_batch) == (
    (4, 8, 16),
    (4, 16, 8),
    (0,),
    (0,),
  )
  assert batched.label().startswith("f32 4 x 8x16 @ 16x8")


def test_dots_mode_counts_the_residual_steps_dots():
  """Depth 1, one attention chunk: q, k, v, out, MLP up and down and the head each run forward,
  input-gradient and weight-gradient dots (7 x 3 = 21); attention's score and value products run
  forward, again in the rematerialised forward, and two gradient dots each (2 x 4 = 8)."""
  base = train_step.shape_overrides(step_bench.parse_args(TOY))
  dots, model = step_dots.mixer_dots(base, "residual", 4)
  assert sum(dots.values()) == 29
  c, v, t, b = 16, 256, 8, 2  # width, vocab, seq_len, batch (TOY)
  dense = 3 * 2 * (4 * c * c + 2 * c * 4 * c + c * v) * b * t
  attention = 4 * 2 * (2 * b * t * t * c)  # scores and values: b x heads x t x t x head_dim each
  assert sum(d.flops * n for d, n in dots.items()) == dense + attention
  assert model == dense + 3 * 2 * (2 * b * t * t * c)  # step_bench counts attention 3x forward


@pytest.mark.parametrize(
  "argv, msg",
  [
    (["--matmul", "256x256"], "error: --matmul: expected MxKxN"),
    (["--set", "model.width=-1"], "error:"),
    (["--mixers", "residual,nope"], "error: --mixers: nope:"),
  ],
)
def test_dots_mode_bad_input_exits_2(argv, msg, capsys):
  assert step_bench.main(TOY + ["--mode", "dots"] + argv) == 2
  assert msg in capsys.readouterr().err


def test_profile_and_compile_modes_run_the_one_step_at_toy_size(capsys):
  """step_bench's other modes time the same train step (train_step.build) at the same shape
  options: profile prints the step's op time by part of the model, compile one figure per depth."""
  fast = ["--steps", "1", "--warmup", "1"]
  assert step_bench.main(TOY + fast + ["--mode", "profile", "--mixers", "mhc", "--top", "3"]) == 0
  out = capsys.readouterr().out
  assert "mhc: median step" in out and "Sinkhorn projection" in out
  sinkhorn = next(line for line in out.splitlines() if line.endswith("Sinkhorn projection"))
  assert float(sinkhorn.split()[0]) > 0  # mHC's step has Sinkhorn ops, found by their place
  argv = ["--mode", "compile", "--mixers", "residual", "--depths", "1", "2", "--repeats", "1"]
  assert step_bench.main(TOY + argv + ["--no-loop"]) == 0
  out = capsys.readouterr().out
  assert "residual scan=True  depth=  1: compile" in out and "depth=  2: compile" in out
  assert "compile ratio depth 2 / depth 1 =" in out


@pytest.mark.parametrize(
  "argv, msg",
  [
    (["--mode", "fast"], "invalid choice: 'fast'"),
    (["--mode", "compile", "--depths", "0", "4"], "error: --depths: expected positive integers"),
  ],
)
def test_step_bench_bad_mode_input(argv, msg, capsys):
  try:
    rc = step_bench.main(TOY + argv)
  except SystemExit as e:  # argparse's own error for a bad choice
    rc = e.code
  assert rc == 2 and msg in capsys.readouterr().err


def test_dots_alone_sums_count_times_time_per_round():
  from collections import Counter

  d = step_dots.Dot("f32", (8, 16), (16, 4), (), (1,), (), (0,))
  times = step_dots.time_dots([Counter({d: 3})], steps=2, warmup=0)
  assert set(times) == {d, "dispatch"} and all(len(v) == 2 for v in times.values())
  as_timed = step_dots.alone_per_round(Counter({d: 3}), times)
  assert as_timed == [3 * t for t in times[d]]
  net = step_dots.alone_per_round(Counter({d: 3}), times, net=True)
  assert net == [3 * max(t - s, 0.0) for t, s in zip(times[d], times["dispatch"])]


def test_step_bench_rates_keep_three_significant_figures():
  """A toy step's rate is a small fraction of the matmul's (about 1e-4 on a loaded CPU): rounded
  to decimals it read 0.0 and failed the table's check on a fresh clone; figures keep it."""
  assert step_bench.sig(0.000412345) == 0.000412 and step_bench.sig(1234.5) == 1230.0
  assert step_bench.sig(0.0) == 0.0 and step_bench.sig(float("nan")) != step_bench.sig(0.0)


def test_step_bench_attention_side_by_side_and_table(tmp_path, capsys):
  """The accelerator check's step_bench options at toy size: a bf16 reference matmul, attention's
  implementations side by side (cuDNN reported as not run on the CPU), the markdown table with
  each mixer's ratio to residual, and all of it in the JSON."""
  out = tmp_path / "gpu.json"
  argv = TOY + ["--mixers", "residual,mhc", "--variants", "bf16", "--all-variants"]
  argv += ["--matmul-dtype", "bfloat16", "--attention", "1x2x16x8", "--steps", "1"]
  assert step_bench.main(argv + ["--warmup", "1", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "| mixer | variant | step | tokens/s | model TFLOP/s | MFU (vs bfloat16 matmul)" in text
  assert "| residual | bf16 |" in text and "| mhc | bf16 |" in text
  rep = json.loads(out.read_text())
  assert rep["matmul"]["dtype"] == "bfloat16" and rep["platform"] == "cpu"
  att = {r["impl"]: r for r in rep["attention"]["rows"]}
  assert set(att) == set(step_bench.ATTENTION_IMPLS)
  assert all(att[i]["fwd_bwd_ms"] > 0 and att[i]["temp_mib"] >= 0 for i in ("materialized", "xla"))
  assert "error" in att["cudnn"] and "cudnn" in text
  assert [(r["mixer"], r["variant"]) for r in rep["rows"]] == [
    ("residual", "bf16"),
    ("mhc", "bf16"),
  ]
  assert all(r["step_s"] > 0 and 0 < r["of_matmul_rate"] for r in rep["rows"])
  assert rep["argv"] == argv + ["--warmup", "1", "--json", str(out)]  # the command that ran


def test_step_bench_bad_attention_shape_exits_2(capsys):
  assert step_bench.main(TOY + ["--attention", "2x16x8"]) == 2
  assert "error: --attention: expected BxHxTxD" in capsys.readouterr().err


def _gpu_check(tmp_path, *args):
  import os
  import subprocess

  env = dict(os.environ, PY=sys.executable)
  env.pop("OUT", None)
  return subprocess.run(
    ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )


def test_gpu_check_refuses_the_cpu_without_toy(tmp_path):
  r = _gpu_check(tmp_path, "--json", str(tmp_path / "x.json"))
  assert r.returncode == 2 and "error: no accelerator visible to jax" in r.stderr
  assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_gpu_check_runs_at_toy_size(tmp_path):
  """benchmarks/gpu_check.sh --toy: the accelerator check's own commands (step_bench with the
  attention side by side, study_cost over every shipped study's GPU variant) at toy size on the
  CPU, so the script cannot rot between the runs on a GPU."""
  out = tmp_path / "gpu_check.json"
  r = _gpu_check(tmp_path, "--toy", "--json", str(out))
  assert r.returncode == 0, r.stdout + r.stderr
  assert "stopped" not in r.stdout and "failed" not in r.stdout, r.stdout
  rep = json.loads(out.read_text())
  rows = rep["step_bench"]["rows"]
  assert [x["mixer"] for x in rows] == ["residual", "hc", "mhc", "mhc_lite"]
  assert all(x["variant"] == "bf16" and x["step_s"] > 0 for x in rows)
  att = {x["impl"]: x for x in rep["step_bench"]["attention"]["rows"]}
  assert att["xla"]["fwd_bwd_ms"] > 0 and "error" in att["cudnn"]
  studies = {s["study"]: s for s in rep["studies"]["studies"]}
  assert {"bayes_depth.yaml", "lr_proxies.yaml", "hc_mhc_scale.yaml"} <= set(studies)
  assert all("error" not in s and s["step_s"] > 0 for s in studies.values()), studies
  assert "| mhc_lite | bf16 |" in r.stdout


def test_stream_spread_cases_and_bad_input(capsys):
  """benchmarks/stream_spread.py: a case is a mixer and its options; a malformed one exits 2."""
  assert stream_spread.parse_case("mhc:stream_init=symmetric:res_diag=0.95") == (
    "mhc",
    ["model.mixer_options.stream_init=symmetric", "model.mixer_options.res_diag=0.95"],
  )
  assert stream_spread.parse_case("hc") == ("hc", [])
  assert stream_spread.main(["mhc:stream_init"]) == 2
  assert "error: case 'mhc:stream_init'" in capsys.readouterr().err


@pytest.mark.slow
def test_stream_spread_runs_a_tiny_case(tmp_path):
  """The benchmark trains a case with mhc-jax train and reads the spread per layer back."""
  r = stream_spread.run_case("mhc", depth=2, steps=10, out=tmp_path / "run")
  assert len(r["spread"]) == 5 and all(0.0 <= v <= 2.0 for v in r["spread"])
  assert r["step"] == 9 and r["loss"] > 0
