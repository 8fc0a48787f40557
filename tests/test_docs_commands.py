"""Every ``mhc-jax`` command quoted in README.md, in docs/**/*.md and in the headers of
configs/**/*.yaml works as written, and none names the study machine's own directories.

Where a command is found: a line of a fenced code block (continuations joined, a ``nice -n 10``
or ``VAR=1`` prefix and a trailing ``# comment`` dropped, a shell loop's ``; done`` cut off), an
inline code span (even one that wraps over lines) and an indented line of a config's header.

``train``, ``sweep`` and ``map`` commands run with ``--dry-run`` (everything up to compiling:
config, data, mesh, the model's initialisation, and for train the step traced on abstract
values; nothing written), in-process through ``cli.main``. Commands that differ only in where
they write (``--out``) or how many runs train at once (``--parallel``) dry-run once and every
one of them is parsed (a study's dry run prepares each of its hundreds of runs: the studies'
dry runs are most of this test's time, docs/results.md "make test"). ``report`` runs once, on a
synthetic sweep directory (the others are parsed); an ``eval``
command's run directory must be the ``--out`` of a train command in the same file, and the slow
test trains the config headers' runs for two steps and runs each eval command as written;
``coord-check`` commands are parsed (it trains: tests/test_coord_check.py runs one).
Placeholders (``DIR``, ``RUN_DIR``, ``MEMBER_DIR``, ``my_corpus.txt``, ``$HOME``, ...) are
filled in; ``[...]`` groups are tried without and with their options; a usage line with
``FILE``, ``MIXER``, ``NAME`` or ``K=V`` in it is parsed only, and one cut short with ``...``
(``--parametrization sp ...``: the rest as above) is checked for machine paths only.
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
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DRY_RUN_KINDS = ("train", "sweep", "map")
# A directory of the machine the studies ran on: a user has none of these.
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|tmp|root|home)(?:/|\b)")
# A usage line, not a command: parsed only, with these filled in.
TEMPLATE_WORDS = {
  "FILE": "configs/sweeps/quickstart.yaml",
  "MIXER": "hc",
  "NAME": "cpu",
  "K=V": "train.steps=2",
}

# ------------------------------------------------------------------------------------------
# Finding the commands.

# The command and the environment assignments just before it (``PYTHONPATH=examples/x``).
_START = re.compile(r"(?:^|(?<=[\s;(&|]))(?:[A-Z_]+=\S+\s+)*mhc-jax\s+\S")


def _command_at(text: str) -> str | None:
  """The ``mhc-jax ...`` command in one line of shell (None if there is none): up to a
  comment, a ``;``, ``&&`` or a pipe (one outside a usage line's ``[a | b]``)."""
  m = _START.search(text)
  if m is None:
    return None
  cmd = re.split(r"\s+#|;|\s&&\s", text[m.start() :])[0]
  depth = 0
  for i, ch in enumerate(cmd):
    depth += {"[": 1, "]": -1}.get(ch, 0)
    if ch == "|" and depth == 0 and cmd[i - 1 : i].isspace():
      cmd = cmd[:i]
      break
  return " ".join(cmd.split())


def block_commands(block: str) -> list[str]:
  """The commands in a code block's lines (``\\`` continuations joined)."""
  out = []
  for line in block.replace("\\\n", " ").splitlines():
    if (cmd := _command_at(line)) is not None:
      out.append(cmd)
  return out


def span_commands(text: str) -> list[str]:
  """The commands in inline code spans (a span may wrap over lines)."""
  spans = re.findall(r"`([^`]+)`", text)
  return [c for s in spans if (c := _command_at(" ".join(s.split()))) is not None]


_FENCE = re.compile(r"^[ \t]*```([^\n]*)\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
SHELL = ("", "bash", "sh", "shell", "console")  # a yaml block's comments are not commands


def markdown_commands(text: str) -> list[str]:
  """Fenced code blocks' commands in order, then the inline spans' of the rest."""
  blocks = [b for lang, b in _FENCE.findall(text) if lang.strip() in SHELL]
  found = [c for b in blocks for c in block_commands(b)]
  return found + span_commands(_FENCE.sub("", text))


def header_text(path: Path) -> str:
  """A YAML file's leading comment, the ``#`` removed from each line."""
  lines = []
  for line in path.read_text().splitlines():
    if not line.startswith("#"):
      break
    lines.append(line[1:])
  return "\n".join(lines)


def header_commands(path: Path) -> list[str]:
  """The commands in a YAML header: its indented command lines (``#   mhc-jax ...``,
  ``#   nice -n 10 mhc-jax ...``) and its prose's inline code spans."""
  text = header_text(path)
  shell = [ln for ln in text.replace("\\\n", " ").splitlines() if _is_shell_line(ln)]
  return block_commands("\n".join(shell)) + span_commands(text)


def _is_shell_line(line: str) -> bool:
  return re.match(r"\s*(?:[A-Z_]+=\S+\s+)*(?:nice\s+-n\s+\d+\s+)?mhc-jax\s", line) is not None


def expand(command: str) -> list[str]:
  """A template's forms: without its ``[...]`` options, then with the first one, the first two,
  ... (``[--out DIR] [--resume]``: --resume goes with --out); of a group's alternatives
  (``[--reference residual,mhc,hc | all]``) the first, and ``K=V ...`` as one ``K=V``."""
  groups = [re.sub(r"\s+\|\s.*$", "", g) for g in re.findall(r"\[([^\]]+)\]", command)]
  groups = [g.replace("K=V ...", "K=V") for g in groups]
  base = re.sub(r"\s*\[[^\]]+\]", "", command)
  return [" ".join([base, *groups[:i]]) for i in range(len(groups) + 1)]


def environment(command: str) -> tuple[dict, str]:
  """``({VAR: value}, the command without them)`` for ``VAR=value mhc-jax ...``."""
  env, words = {}, command.split(" ")
  while "=" in words[0] and words[0] != "mhc-jax":
    k, v = words.pop(0).split("=", 1)
    env[k] = v
  return env, " ".join(words)


def kind_of(command: str) -> str:
  return environment(command)[1].split()[1]


def _where(path: Path) -> str:
  return str(path.relative_to(ROOT))


def documented() -> list[tuple[str, str]]:
  """(where, command) for every documented command, templates expanded, in file order;
  ``mhc-jax eval`` alone (two words) names a command and is left out."""
  out = [(_where(p), c) for p in PAGES for c in markdown_commands(p.read_text())]
  out += [(_where(p), c) for p in HEADERS for c in header_commands(p)]
  seen, unique = set(), []
  for where, template in out:
    for c in expand(template):
      if len(environment(c)[1].split()) > 2 and (where, c) not in seen:
        seen.add((where, c))
        unique.append((where, c))
  return unique


COMMANDS = documented()
SUBCOMMANDS = set(cli.build_parser()._subparsers._group_actions[0].choices)

# ------------------------------------------------------------------------------------------
# Running them.


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


PLACEHOLDERS = ("DIR", "RUN_DIR", "SWEEP_DIR", "MEMBER_DIR", "OUT", "RUN", "R")


def argv_of(command: str, tmp: Path) -> list[str]:
  words = shlex.split(os.path.expandvars(environment(command)[1]))
  assert words[0] == "mhc-jax"
  subst = {p: str(tmp / p) for p in PLACEHOLDERS} | {"N": "2", "K": "2"} | TEMPLATE_WORDS
  return [subst.get(w, w) for w in words[1:]]


def is_template(command: str) -> bool:
  return bool(TEMPLATE_WORDS.keys() & set(command.split()))


def group_key(command: str) -> tuple:
  """Commands with one key give one dry run: they differ only in --out, --parallel, --quiet
  and --dry-run (a train command with --resume keeps its --out, which it reads)."""
  words = shlex.split(environment(command)[1])[1:]
  if "..." in words:
    return ("abbreviated", command)
  if words[0] == "report":  # on the same synthetic sweep: one run, whatever the directory
    return ("report", *words[2:])
  if is_template(command) or words[0] not in DRY_RUN_KINDS:
    return ("parse", command)
  drop_value = ("--parallel",) if "--resume" in words else ("--out", "--parallel")
  key, skip = [], False
  for w in words:
    if skip:
      skip = False
    elif w in drop_value:
      skip = True
    elif w not in ("--dry-run", "--quiet"):
      key.append(w)
  return tuple(key)


GROUPS: dict[tuple, list[tuple[str, str]]] = {}
for _wc in COMMANDS:
  GROUPS.setdefault(group_key(_wc[1]), []).append(_wc)
GROUP_IDS = [
  f"{v[0][0]}: {v[0][1]}" + (f" (+{len(v) - 1})" if len(v) > 1 else "") for v in GROUPS.values()
]


def _files(tmp: Path) -> set:
  return {p for p in tmp.rglob("*") if "configs" not in p.parts}


def _is_tfds_without_data(argv, err: str) -> bool:
  """configs/tfds_shakespeare.yaml's commands need TFDS's dataset prepared first (its header
  says how; this machine is offline): then the one error names data.options.data_dir."""
  return any("tfds" in a for a in argv) and "data.options.data_dir" in err


def _parses(argv: list[str], capsys) -> None:
  try:
    cli.build_parser().parse_args(argv)
  except SystemExit as e:  # the parser's one error: line
    pytest.fail(f"{argv}: exit {e.code}: {capsys.readouterr().err}")


def _check_eval(where: str, argv: list[str], tmp: Path) -> None:
  """A run directory that is not a placeholder is a train command's --out in the same file."""
  run = argv[argv.index("--run") + 1]
  if Path(run).name in PLACEHOLDERS or "$" in run:
    return
  outs = set()
  for w, c in COMMANDS:
    a = argv_of(c, tmp)
    if w == where and a[0] == "train" and "--out" in a:
      outs.add(a[a.index("--out") + 1])
  assert run in outs, (where, run, outs)


def _run_dry(command: str, workdir: Path, capsys, monkeypatch) -> None:
  env, _ = environment(command)
  for k, v in env.items():  # PYTHONPATH=examples/my_mixer: the user's package, importable
    if k == "PYTHONPATH":
      for d in v.split(os.pathsep):
        monkeypatch.syspath_prepend(str(ROOT / d))
    else:
      monkeypatch.setenv(k, v)
  argv = argv_of(command, workdir)
  kind = argv[0]
  if kind == "train" and "--resume" in argv:  # a run directory to continue (config only)
    out = Path(argv[argv.index("--out") + 1])
    out.mkdir(parents=True)
    if "--config" in argv:
      sets = argv[argv.index("--set") + 1 : argv.index("--out")] if "--set" in argv else []
      cfg = load_config(argv[argv.index("--config") + 1], sets)
    else:  # a population member's own directory (docs/interfaces.md): any saved config
      cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    save_config(with_data_vocab(cfg, 18), out / "config.yaml")  # 18: the bijection's vocab
  if "--dry-run" not in argv:
    argv.append("--dry-run")
  before = _files(workdir)
  rc = cli.main(argv)
  out, err = capsys.readouterr()
  if rc == 2 and _is_tfds_without_data(argv, err):
    assert err.count("error: ") == 1
    return
  assert rc == 0, f"{command}: {err}"
  assert _files(workdir) == before, "a dry run wrote files"
  if kind in ("train", "sweep"):
    assert "dry run" in out or "train_flops" in out or "FLOPs" in out, out


@pytest.fixture(scope="module", autouse=True)
def _one_read_of_each_corpus():
  """A study's dry run prepares each of its hundreds of runs, and each reads the same text
  corpus (the stdlib's sources) again: here each corpus is read once per process. The bytes
  are the same; only the repeated reads go."""
  from mhc_jax.data import text

  read = text.read_corpus
  cache = {}

  def read_once(files, max_bytes=None):
    key = (tuple(files), max_bytes)
    if key not in cache:
      cache[key] = read(key[0], max_bytes)
    return cache[key]

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(text, "read_corpus", read_once)
    yield


@pytest.mark.parametrize("key", list(GROUPS), ids=GROUP_IDS)
def test_documented_command_works(key, workdir, capsys, monkeypatch):
  members = GROUPS[key]
  if key[0] == "abbreviated":  # `... --parametrization sp ...`: the rest as on the line above
    assert all(kind_of(c) in SUBCOMMANDS for _, c in members)
    return
  for where, command in members:
    argv = argv_of(command, workdir)
    _parses(argv, capsys)
    if argv[0] == "eval":
      _check_eval(where, argv, workdir)
  where, command = members[0]
  argv = argv_of(command, workdir)
  kind = argv[0]
  if key[0] == "parse":
    return  # eval: the slow test runs the headers'; coord-check: tests/test_coord_check.py
  if kind == "report":
    make_sweep(Path(argv[1]))
    assert cli.main(argv) == 0, capsys.readouterr().err
    return
  _run_dry(command, workdir, capsys, monkeypatch)


# ------------------------------------------------------------------------------------------
# What was found, and where a user's output goes.


def test_the_documents_quote_commands_of_every_kind():
  kinds = {argv_of(c, ROOT)[0] for _, c in COMMANDS}
  assert {"train", "sweep", "report", "eval", "coord-check"} <= kinds, kinds
  assert kinds <= SUBCOMMANDS, kinds - SUBCOMMANDS  # `map` once the docs quote it
  assert len(COMMANDS) >= 100
  wheres = {w for w, _ in COMMANDS}
  assert {"README.md", "configs/quickstart.yaml", "docs/results.md"} <= wheres
  assert any(w.startswith("docs/studies/") for w in wheres)
  for found in [
    ("configs/quickstart.yaml", "mhc-jax train --config configs/quickstart.yaml"),
    # `nice -n 10` dropped, in a header and in a study page's code block
    (
      "configs/studies/lr_curves.yaml",
      "mhc-jax sweep configs/studies/lr_curves.yaml --parallel 2 --out sweeps_out/lr_curves",
    ),
    (
      "docs/studies/zoo_map/README.md",
      "mhc-jax sweep configs/studies/zoo_map.yaml --parallel 2 --out sweeps_out/zoo_map",
    ),
    # an inline span that wraps over two lines of prose, with an environment prefix
    (
      "docs/performance.md",
      "MHC_JAX_HUGEPAGES=0 mhc-jax train --config configs/quickstart.yaml --set model.mixer=mhc",
    ),
    # continued lines of a code block
    (
      "docs/parametrization.md",
      "mhc-jax train --config configs/quickstart.yaml --set model.parametrization=completep "
      "model.base_width=32 model.base_depth=2 model.width=64 model.depth=4",
    ),
  ]:
    assert found in COMMANDS, found


def test_the_scan_reads_what_a_page_quotes():
  page = """Prose that names `mhc-jax eval` and mhc-jax sweep outside code.

```bash
nice -n 10 mhc-jax sweep configs/a.yaml --parallel 2 \\
  --out sweeps_out/a   # a comment
for r in sweeps_out/a/runs/*; do mhc-jax eval --run "$r"; done
python analysis.py sweeps_out/a
```

Then `X=0 mhc-jax train --config configs/b.yaml --set
model.depth=2` wraps, and a usage line `mhc-jax map M [--reference a | all] [--out DIR]` keeps
its alternatives where `mhc-jax eval --run R | tee log` ends at the pipe.
"""
  assert markdown_commands(page) == [
    "mhc-jax sweep configs/a.yaml --parallel 2 --out sweeps_out/a",
    'mhc-jax eval --run "$r"',
    "mhc-jax eval",
    "X=0 mhc-jax train --config configs/b.yaml --set model.depth=2",
    "mhc-jax map M [--reference a | all] [--out DIR]",
    "mhc-jax eval --run R",
  ]
  assert expand("mhc-jax map M [--reference a | all] [--set K=V ...]") == [
    "mhc-jax map M",
    "mhc-jax map M --reference a",
    "mhc-jax map M --reference a --set K=V",
  ]
  assert environment("A=1 B=x/y mhc-jax map M") == ({"A": "1", "B": "x/y"}, "mhc-jax map M")
  assert expand("mhc-jax sweep f.yaml [--out DIR] [--dry-run]") == [
    "mhc-jax sweep f.yaml",
    "mhc-jax sweep f.yaml --out DIR",
    "mhc-jax sweep f.yaml --out DIR --dry-run",
  ]
  assert MACHINE_PATH.search("--out /work/sweeps/x") and MACHINE_PATH.search("--out /tmp")
  assert not MACHINE_PATH.search("--out sweeps_out/work/x") and not MACHINE_PATH.search("~/tmp")


def test_no_documented_command_writes_to_the_study_machine():
  """Output under sweeps_out/<study> or runs/<name>, relative: never /work, /tmp, /root or
  /home, which exist only on the machine the studies ran on."""
  bad = [(w, c) for w, c in COMMANDS if MACHINE_PATH.search(c)]
  assert not bad, bad


def _shell_lines() -> list[tuple[str, str]]:
  """(where, line) for every line of a code block in the pages and every command line of a
  config header: what a user copies, whatever the program (python analysis.py, a loop, ...)."""
  out = []
  for p in PAGES:
    for _, block in _FENCE.findall(p.read_text()):
      out += [(_where(p), ln) for ln in block.splitlines()]
  for p in HEADERS:
    out += [(_where(p), ln) for ln in header_text(p).splitlines() if ln.startswith("   ")]
  return out


def test_no_copied_line_names_the_study_machine():
  lines = _shell_lines()
  assert len(lines) > 200
  bad = [(w, ln.strip()) for w, ln in lines if MACHINE_PATH.search(ln)]
  assert not bad, bad


def test_every_command_is_where_the_scan_reads_it():
  """A command in an indented (4-space) Markdown code block would be missed: they are fenced."""
  bad = []
  for p in PAGES:
    text = _FENCE.sub("", p.read_text())
    indented = re.compile(r" {4,}(?:[A-Z_]+=\S+\s+)*(?:nice\s+-n\s+\d+\s+)?mhc-jax\s")
    bad += [(_where(p), ln) for ln in text.splitlines() if indented.match(ln)]
  assert not bad, bad


# ------------------------------------------------------------------------------------------
# The slow test: the headers' eval commands on the runs their train commands make.


def _eval_pairs() -> list[tuple[str, str, str]]:
  """(file, train command, eval command) for each config header's eval and the train that
  feeds it."""
  pairs = []
  for where, group in itertools.groupby(COMMANDS, key=lambda wc: wc[0]):
    if not where.startswith("configs/"):
      continue
    cmds = [c for _, c in group]
    for e in (c for c in cmds if kind_of(c) == "eval" and "--run" in c):
      run = e.split("--run", 1)[1].split()[0]
      if run in PLACEHOLDERS:
        continue
      train = next(c for c in cmds if kind_of(c) == "train" and f"--out {run}" in c)
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
