"""A fake Google Cloud Storage for tests: fsspec's in-memory filesystem registered for the
``gs`` (and ``gcs``) protocol, which etils ``epath`` reaches ``gs://`` paths through. The ``gcs``
fixture (re-exported by conftest) yields ``gs://bucket`` and checks nothing landed on local disk.
"""

from __future__ import annotations

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem


class FakeGCS(MemoryFileSystem):
  """An in-memory filesystem answering for gs:// (and gcs://, the name epath asks for)."""

  protocol = ("gs", "gcs")
  store: dict = {}
  pseudo_dirs = [""]

  @classmethod
  def _strip_protocol(cls, path):
    for pre in ("gs://", "gcs://"):
      if path.startswith(pre):
        path = path[len(pre) :]
    return MemoryFileSystem._strip_protocol(path)


@pytest.fixture
def gcs(tmp_path, monkeypatch):
  """``gs://bucket`` in memory; the test runs in an empty local directory it checks stays so."""
  import importlib

  registry = importlib.import_module("fsspec.registry")  # the module (fsspec.registry is a view)
  saved = {n: registry._registry.get(n) for n in FakeGCS.protocol}
  for n in FakeGCS.protocol:
    fsspec.register_implementation(n, FakeGCS, clobber=True)
  FakeGCS.store.clear()
  FakeGCS.pseudo_dirs[:] = [""]
  monkeypatch.chdir(tmp_path)
  yield "gs://bucket"
  for n, cls in saved.items():
    if cls is None:
      registry._registry.pop(n, None)
    else:
      registry._registry[n] = cls
  FakeGCS.store.clear()
  assert list(tmp_path.iterdir()) == [], "something was written to the local disk"


def keys() -> set[str]:
  """Every object in the fake store, as ``bucket/path``."""
  return {k.lstrip("/") for k in FakeGCS.store}
