"""The package has no import circle: the graph of every ``mhc_jax`` import (module level and
inside functions alike; a lazy import does not make a circle go away) is acyclic.

An edge goes from a module to the module it names (``from mhc_jax.x import y`` -> ``mhc_jax.x``,
or ``mhc_jax.x.y`` where that is a module); ``if __name__ == "__main__":`` blocks are left out
(they run only as a script, after every import is done)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mhc_jax"


def _module(path: Path) -> str:
  parts = path.relative_to(PKG.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_main_block(node: ast.AST) -> bool:
  return (
    isinstance(node, ast.If)
    and isinstance(node.test, ast.Compare)
    and isinstance(node.test.left, ast.Name)
    and node.test.left.id == "__name__"
  )


def import_graph() -> dict[str, set[str]]:
  modules = {_module(p): p for p in PKG.rglob("*.py")}
  graph: dict[str, set[str]] = {m: set() for m in modules}
  for mod, path in modules.items():
    tree = ast.parse(path.read_text())
    skip = {id(n) for top in tree.body if _is_main_block(top) for n in ast.walk(top)}
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):
      if id(node) in skip:
        continue
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


def test_training_processes_import_no_report_libraries():
  """A training process (``mhc-jax train``, a sweep worker, a population, ``mhc-jax eval``)
  never imports pandas or matplotlib: every process the sweeps and the tests start pays for
  what it imports (pandas alone took ~0.35 s per process), and only the readers and the
  report need them."""
  import subprocess
  import sys

  code = (
    "import sys\n"
    "import mhc_jax.cli, mhc_jax.train.loop, mhc_jax.sweep.worker, mhc_jax.sweep.population\n"
    "import mhc_jax.evaluate\n"
    "print(sorted(m for m in ('pandas', 'matplotlib') if m in sys.modules))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
