"""Where the test suite's time goes: JAX's compile, trace and lowering seconds per test.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -n 2 -p suite_times --suite-times /tmp/times
    .venv/bin/python benchmarks/suite_times.py /tmp/times [--top 20]

As a pytest plugin (``-p suite_times``, with ``benchmarks`` on the path) it records, in each
test process (each xdist worker), the durations JAX reports through ``jax.monitoring`` (XLA
backend compiles, jaxpr traces, lowerings to MLIR, orbax writes) summed per test, plus each
test's CPU seconds (its process's, and those of the subprocesses it started and waited for: a
cost that a loaded machine does not inflate as it does wall time), into ``DIR/<worker>.json``.
As a script it sums those files: totals per event, then per test file and the tests with the
most backend-compile time, and the tests with the most CPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
from pathlib import Path

import pytest

COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"

CPU = "cpu_s"  # per test: user + system seconds of the test process and its waited-for children
_state = {"dir": None, "test": None, "cpu0": 0.0}
_total: collections.Counter = collections.Counter()
_count: collections.Counter = collections.Counter()
_per: dict = collections.defaultdict(collections.Counter)


def pytest_addoption(parser):
  parser.addoption("--suite-times", metavar="DIR", help="write JAX's per-test durations here")


def _listen(event: str, duration: float, **_) -> None:
  _total[event] += duration
  _count[event] += 1
  if _state["test"]:
    _per[_state["test"]][event] += duration


def pytest_configure(config):
  out = config.getoption("--suite-times")
  if not out:
    return
  if not hasattr(config, "workerinput"):  # the xdist controller, or the one test process
    if any(Path(out).glob("*.json")):
      raise pytest.UsageError(f"--suite-times: {out} already holds records; give a new directory")
    if getattr(config.option, "numprocesses", None):
      return  # the controller runs no tests
  import jax.monitoring  # after conftest.py has set the XLA flags

  _state["dir"] = Path(out)
  jax.monitoring.register_event_duration_secs_listener(_listen)


def _cpu() -> float:
  s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def pytest_runtest_logstart(nodeid, location):
  _state["test"], _state["cpu0"] = nodeid, _cpu()


def pytest_runtest_logfinish(nodeid, location):
  if _state["dir"] is not None and _state["test"] == nodeid:
    _per[nodeid][CPU] += _cpu() - _state["cpu0"]


def pytest_unconfigure(config):
  if _state["dir"] is None:
    return
  ru = resource.getrusage(resource.RUSAGE_SELF)
  _state["dir"].mkdir(parents=True, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  rec = {
    "cpu_s": ru.ru_utime + ru.ru_stime,
    "total": dict(_total),
    "count": dict(_count),
    "per_test": {k: dict(v) for k, v in _per.items()},
  }
  (_state["dir"] / f"{worker}.json").write_text(json.dumps(rec))


def summarize(paths: list[Path], top: int) -> str:
  total, count, per, cpu = collections.Counter(), collections.Counter(), {}, 0.0
  for p in paths:
    rec = json.loads(p.read_text())
    cpu += rec["cpu_s"]
    total.update(rec["total"])
    count.update(rec["count"])
    per.update(rec["per_test"])  # each test runs in one process: its record is in one file
  lines = [f"{len(paths)} test process(es), {cpu:.1f} CPU s in them (subprocesses not counted)"]
  lines += ["seconds  events  event"]
  spans = [(k, v) for k, v in total.most_common() if "since_last" not in k]  # not work: gaps
  lines += [f"{v:7.1f} {count[k]:7d}  {k}" for k, v in spans[:8]]
  files = collections.defaultdict(collections.Counter)
  for k, v in per.items():
    files[k.split("::")[0]].update({e: v.get(e, 0.0) for e in (COMPILE, TRACE, LOWER)})
  lines += ["", "compile   trace   lower  test file"]
  for f, c in sorted(files.items(), key=lambda kv: -kv[1][COMPILE])[:top]:
    lines.append(f"{c[COMPILE]:7.1f} {c[TRACE]:7.1f} {c[LOWER]:7.1f}  {f}")
  lines += ["", "compile   trace   lower  test"]
  for k, v in sorted(per.items(), key=lambda kv: -kv[1].get(COMPILE, 0.0))[:top]:
    lines.append(f"{v.get(COMPILE, 0):7.1f} {v.get(TRACE, 0):7.1f} {v.get(LOWER, 0):7.1f}  {k}")
  lines += ["", "  CPU s  test (with its subprocesses)"]
  for k, v in sorted(per.items(), key=lambda kv: -kv[1].get(CPU, 0.0))[:top]:
    lines.append(f"{v.get(CPU, 0):7.1f}  {k}")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("dir", type=Path)
  ap.add_argument("--top", type=int, default=15)
  args = ap.parse_args(argv)
  paths = sorted(args.dir.glob("*.json"))
  if not paths:
    print(f"error: no per-process records (*.json) in {args.dir}", file=sys.stderr)
    return 2
  print(summarize(paths, args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
