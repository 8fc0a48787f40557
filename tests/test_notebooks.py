"""The notebooks execute without error against the tiny sweep of test_sweep.py (nbclient).

The kernel is the ``python3`` kernelspec, checked to start this interpreter (the venv's);
the notebooks find their data through MHC_SWEEP_DIR / MHC_RUN_DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from test_sweep import tiny_sweep  # noqa: E402,F401  (the shared session fixture)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_three_notebooks():
  assert [p.name for p in NOTEBOOKS] == [
    "01_quickstart.ipynb",
    "02_stability_sweep.ipynb",
    "03_bayesian_geometry.ipynb",
  ]


def _kernel_python() -> str:
  from jupyter_client.manager import KernelManager

  km = KernelManager(kernel_name="python3")
  return km.format_kernel_cmd()[0]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tiny_sweep, monkeypatch, tmp_path):  # noqa: F811
  assert Path(_kernel_python()).resolve() == Path(sys.executable).resolve(), (
    "the python3 kernelspec does not start this interpreter"
  )
  out = tiny_sweep["out"]
  monkeypatch.setenv("MHC_SWEEP_DIR", str(out))
  monkeypatch.setenv("MHC_RUN_DIR", str(out / "runs" / "mixer=mhc"))
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()  # raises CellExecutionError on the first failing cell
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert not errors
  images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
  assert images >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_carry_their_outputs(path):
  """What a reader opening the repository online sees: every code cell executed (by
  notebooks/execute.py), no error output, and the figures (at least two per notebook)."""
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.get("execution_count") for c in code), "run notebooks/execute.py"
  outputs = [o for c in code for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2
  assert nb.cells[0].cell_type == "markdown" and "MHC_" in nb.cells[0].source
  # paths printed relative to the notebook: nothing of the machine that executed them
  text = json.dumps(outputs)
  assert str(ROOT) not in text and "/work/" not in text and "/home/" not in text
