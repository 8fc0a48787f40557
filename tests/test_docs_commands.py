"""Every ``mhc-jax`` command quoted in README.md and in the headers of configs/*.yaml and
configs/sweeps/*.yaml works as written.

``train`` and ``sweep`` commands run with ``--dry-run`` (everything up to compiling: config,
data, mesh, the model's initialisation and the train step traced on abstract values; nothing
written); ``report`` runs on a synthetic sweep directory; an ``eval`` command's run directory
must be the ``--out`` of a train command in the same file, and the slow test trains those runs
for two steps and runs each eval command as written. Placeholders (``DIR``, ``RUN_DIR``,
``SWEEP_DIR``, ``my_corpus.txt``, ``$HOME``) are filled in; the README's optional ``[...]``
groups are tried without and with their options.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from pathlib import Path

import pytest
from fixtures_logs import make_sweep

from mhc_jax import cli
from mhc_jax.train.config import load_config, save_config, with_data_vocab

ROOT = Path(__file__).resolve().parents[1]
HEADERS = sorted((ROOT / "configs").rglob("*.yaml"))


def header_commands(path: Path) -> list[str]:
  """The ``mhc-jax ...`` commands in a YAML file's leading comment (continuations joined,
  trailing comments dropped)."""
  lines = []
  for line in path.read_text().splitlines():
    if not line.startswith("#"):
      break
    lines.append(line[1:].strip())
  text = "\n".join(lines).replace("\\\n", " ")
  out = []
  for line in text.splitlines():
    if line.startswith("mhc-jax "):
      out.append(re.sub(r"\s+#.*$", "", line).strip())
  return out


def readme_commands() -> list[str]:
  text = (ROOT / "README.md").read_text()
  found = []
  for block in re.findall(r"```(?:bash)?\n(.*?)```", text, re.S):
    found += [ln.strip() for ln in block.splitlines() if ln.strip().startswith("mhc-jax ")]
  found += re.findall(r"`(mhc-jax [^`]+)`", text)
  found = [re.sub(r"\s+#.*$", "", c) for c in found]
  return [c for c in found if len(c.split()) > 2]  # `mhc-jax eval` alone names a command


def expand(command: str) -> list[str]:
  """A README template's forms: without its ``[...]`` options, then with the first one, the
  first two, ... (``[--out DIR] [--resume]``: --resume goes with --out)."""
  groups = re.findall(r"\[([^\]]+)\]", command)
  base = re.sub(r"\s*\[[^\]]+\]", "", command)
  return [" ".join([base, *groups[:i]]) for i in range(len(groups) + 1)]


def documented() -> list[tuple[str, str]]:
  """(where, command) for every documented command, templates expanded, in file order."""
  out = [("README.md", c) for t in readme_commands() for c in expand(t)]
  out += [(str(p.relative_to(ROOT)), c) for p in HEADERS for c in header_commands(p)]
  seen, unique = set(), []
  for item in out:
    if item not in seen:
      seen.add(item)
      unique.append(item)
  return unique


COMMANDS = documented()
IDS = [f"{w}: {c}" for w, c in COMMANDS]


def test_the_documents_quote_commands_of_every_kind():
  kinds = {c.split()[1] for _, c in COMMANDS}
  assert kinds == {"train", "sweep", "report", "eval", "coord-check"}, kinds
  assert (
    "configs/quickstart.yaml",
    "mhc-jax train --config configs/quickstart.yaml --set model.mixer=residual",
  ) in COMMANDS
  assert len(COMMANDS) >= 20


@pytest.fixture
def workdir(tmp_path, monkeypatch):
  """A directory to run commands in as from the repository root (configs/ as there)."""
  (tmp_path / "configs").symlink_to(ROOT / "configs")
  (tmp_path / "my_corpus.txt").write_text(
    (ROOT / "README.md").read_text() * 40
  )  # some text for the text config's --set path
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  return tmp_path


def argv_of(command: str, tmp: Path) -> list[str]:
  words = shlex.split(os.path.expandvars(command))
  assert words[0] == "mhc-jax"
  subst = {
    "DIR": str(tmp / "DIR"),
    "RUN_DIR": str(tmp / "RUN_DIR"),
    "SWEEP_DIR": str(tmp / "SWEEP_DIR"),
  }
  return [subst.get(w, w) for w in words[1:]]


def _files(tmp: Path) -> set:
  return {p for p in tmp.rglob("*") if "configs" not in p.parts}


def _is_tfds_without_data(argv, err: str) -> bool:
  """configs/tfds_shakespeare.yaml's commands need TFDS's dataset prepared first (its header
  says how; this machine is offline): then the one error names data.options.data_dir."""
  return any("tfds" in a for a in argv) and "data.options.data_dir" in err


@pytest.mark.parametrize("where,command", COMMANDS, ids=IDS)
def test_documented_command_works(where, command, workdir, capsys):
  argv = argv_of(command, workdir)
  kind = argv[0]
  if kind == "eval":
    run = Path(argv[argv.index("--run") + 1])
    if run.name != "RUN_DIR":  # a header's eval reads the run its train command makes
      outs = {
        argv_of(c, workdir)[argv_of(c, workdir).index("--out") + 1]
        for w, c in COMMANDS
        if w == where and "--out" in c and c.split()[1] == "train"
      }
      assert str(run) in outs or os.fspath(run) in outs, (run, outs)
    cli.build_parser().parse_args(argv)  # it is a valid command; the slow test runs it
    return
  if kind == "coord-check":  # it trains: tests/test_coord_check.py runs one
    cli.build_parser().parse_args(argv)
    return
  if kind == "report":
    make_sweep(Path(argv[1]))
  if kind == "train" and "--resume" in argv:  # a run directory to continue (config only)
    out = Path(argv[argv.index("--out") + 1])
    out.mkdir(parents=True)
    sets = argv[argv.index("--set") + 1 : argv.index("--out")] if "--set" in argv else []
    cfg = load_config(argv[argv.index("--config") + 1], sets)
    save_config(with_data_vocab(cfg, 18), out / "config.yaml")  # 18: the bijection's vocab
  if kind in ("train", "sweep") and "--dry-run" not in argv:
    argv.append("--dry-run")
  before = _files(workdir)
  rc = cli.main(argv)
  out, err = capsys.readouterr()
  if rc == 2 and _is_tfds_without_data(argv, err):
    assert err.count("error: ") == 1
    return
  assert rc == 0, f"{command}: {err}"
  if kind in ("train", "sweep"):
    assert _files(workdir) == before, "a dry run wrote files"
    assert "dry run" in out or "train_flops" in out or "FLOPs" in out, out


def _eval_pairs() -> list[tuple[str, str, str]]:
  """(file, train command, eval command) for each header eval and the train that feeds it."""
  pairs = []
  for where, group in itertools.groupby(COMMANDS, key=lambda wc: wc[0]):
    cmds = [c for _, c in group]
    for e in (c for c in cmds if c.split()[1] == "eval" and "RUN_DIR" not in c):
      run = e.split("--run", 1)[1].split()[0]
      train = next(c for c in cmds if c.split()[1] == "train" and f"--out {run}" in c)
      pairs.append((where, train, e))
  return pairs


@pytest.mark.slow
@pytest.mark.parametrize("where,train,evaluate", _eval_pairs(), ids=[p[0] for p in _eval_pairs()])
def test_documented_eval_commands_run(where, train, evaluate, workdir, capsys):
  """Each header's eval command on the run its train command makes (2 steps, toy size)."""
  argv = argv_of(train, workdir) + [
    "--quiet",
    "--set",
    "train.steps=2",
    "optim.warmup_steps=1",
    "train.eval_every=0",
    "train.diag_every=0",
    "train.ckpt_every=0",
    # The papers' sizes (9 blocks, width 256) cost minutes on the CPU for the same code path.
    "model.depth=2",
    "model.width=32",
    "model.heads=2",
  ]
  rc = cli.main(argv)
  out, err = capsys.readouterr()
  if rc == 2 and _is_tfds_without_data(argv, err):
    return
  assert rc == 0, err
  rc = cli.main(argv_of(evaluate, workdir))
  out, err = capsys.readouterr()
  assert rc == 0, f"{evaluate}: {err}"
  assert "eval.json" in out
