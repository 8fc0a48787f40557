"""The package's import graph has no circle and no import that runs up a floor.

The graph holds every ``mhc_jax`` import, at module level, inside functions and in
``if __name__ == "__main__":`` blocks alike: a lazy import does not make a circle or an upward
dependency go away, and a script block that imports the CLI ties its module to the CLI.
An edge goes from a module to the module it names (``from mhc_jax.x import y`` -> ``mhc_jax.x``,
or ``mhc_jax.x.y`` where that is a module).

The floors, from the ground up (:data:`FLOORS`); a module may import modules on its own floor or
below, never above:

0. the ground: every top-level module and package but those named below: the science
   (sinkhorn, mixers, model, diagnostics, spikes, data, posterior, probes, testing, baselines)
   and the plumbing it shares with training (errors, storage, rundir, logs, tb);
1. ``mhc_jax.train``: one training run;
2. ``mhc_jax.evaluate``: a trained run's held-out evaluation (it restores train's state), and
   ``mhc_jax.coord_check``: short training runs at several sizes, compared;
3. the sweep's parts (``mhc_jax.sweep``, but grid and runner): the settings, the manifest, the
   population, the worker, the executor, progress, post-run evaluation and the report;
4. the sweep's plan and driver: ``mhc_jax.sweep.grid`` (a sweep file expanded into runs and
   populations) and ``mhc_jax.sweep.runner`` (which puts the parts together);
5. ``mhc_jax.cli``: the command line, over everything.

Within a floor any import is allowed as long as the graph stays acyclic."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mhc_jax"


def _module(path: Path) -> str:
  parts = path.relative_to(PKG.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The floors, lowest first: a module's floor is that of the longest prefix listed (the ground, 0,
# where none is). See the module docstring for what each floor holds.
FLOORS: dict[str, int] = {
  "mhc_jax.train": 1,
  "mhc_jax.evaluate": 2,
  "mhc_jax.coord_check": 2,
  "mhc_jax.sweep": 3,
  "mhc_jax.sweep.grid": 4,
  "mhc_jax.sweep.runner": 4,
  "mhc_jax.sweep.design_map": 4,
  "mhc_jax.cli": 5,
}


def floor(module: str) -> int:
  parts = module.split(".")
  for i in range(len(parts), 0, -1):
    if (prefix := ".".join(parts[:i])) in FLOORS:
      return FLOORS[prefix]
  return 0


def import_graph() -> dict[str, set[str]]:
  modules = {_module(p): p for p in PKG.rglob("*.py")}
  graph: dict[str, set[str]] = {m: set() for m in modules}
  for mod, path in modules.items():
    tree = ast.parse(path.read_text())
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
          base = ".".join(up + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
      for n in names:
        if n in modules and n != mod:
          graph[mod].add(n)
  return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(m: str) -> list[str] | None:
    state[m] = 1
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        return stack[stack.index(n) :] + [n]
      if n not in state and (found := visit(n)):
        return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_cycle_finder_finds_a_planted_circle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_circle():
  graph = import_graph()
  assert "mhc_jax.cli" in graph and graph["mhc_jax.cli"]  # the graph was read
  circle = _cycle(graph)
  assert circle is None, " -> ".join(circle)


def test_the_graph_counts_lazy_and_script_imports():
  graph = import_graph()
  assert "mhc_jax.sweep.options" in graph["mhc_jax.sweep.grid"]  # inside a function
  assert "mhc_jax.train.loop" in graph["mhc_jax.cli"]  # inside a function


def test_every_module_has_a_floor_and_the_floors_are_as_documented():
  graph = import_graph()
  assert all(prefix in graph for prefix in FLOORS), set(FLOORS) - set(graph)
  assert [floor(m) for m in ("mhc_jax.sinkhorn", "mhc_jax.mixers.mhc", "mhc_jax.rundir")] == [0] * 3
  assert floor("mhc_jax.train.config") == 1 and floor("mhc_jax.evaluate") == 2
  assert floor("mhc_jax.sweep.population") == 3 and floor("mhc_jax.sweep.grid") == 4
  assert floor("mhc_jax.cli") == 5


def _upward(graph: dict[str, set[str]]) -> list[str]:
  return sorted(
    f"{m} (floor {floor(m)}) -> {n} (floor {floor(n)})"
    for m, ns in graph.items()
    for n in ns
    if floor(n) > floor(m)
  )


def test_upward_finder_finds_a_planted_import():
  planted = {"mhc_jax.rundir": {"mhc_jax.train.config"}, "mhc_jax.train.config": set()}
  assert _upward(planted) == ["mhc_jax.rundir (floor 0) -> mhc_jax.train.config (floor 1)"]


def test_no_import_runs_up_a_floor():
  upward = _upward(import_graph())
  assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_training_processes_import_no_report_libraries():
  """A training process (``mhc-jax train``, a sweep job, a population, ``mhc-jax eval``)
  never imports pandas or matplotlib: every process the sweeps and the tests start pays for
  what it imports (pandas alone took ~0.35 s per process), and only the readers and the
  report need them."""
  import subprocess
  import sys

  code = (
    "import sys\n"
    "import mhc_jax.cli, mhc_jax.train.loop, mhc_jax.sweep.runner, mhc_jax.sweep.population\n"
    "import mhc_jax.evaluate\n"
    "print(sorted(m for m in ('pandas', 'matplotlib') if m in sys.modules))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_plain_install_has_what_the_default_sweep_runs_on():
  """`pip install -e .` (no extras) then `mhc-jax sweep FILE`: the default executor is
  submitit's LocalExecutor, so submitit is a core dependency, not the `cluster` extra (a fresh
  user environment hit ModuleNotFoundError)."""
  import tomllib

  project = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]
  core = {
    d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
    for d in project["dependencies"]
  }
  assert "submitit" in core
