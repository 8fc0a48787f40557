"""Byte-level text sources: local files (written here) and TFDS (mocked), resumable batches."""

import os

import numpy as np
import pytest

from mhc_jax.data import make_source
from mhc_jax.data.text import ByteWindows, stdlib_dir

SEQ = 16


@pytest.fixture()
def corpus_dir(tmp_path):
  rng = np.random.default_rng(0)
  d = tmp_path / "corpus"
  (d / "sub").mkdir(parents=True)
  for name in ("a.txt", "b.txt", "sub/c.txt"):
    (d / name).write_bytes(rng.integers(0, 256, 1500, dtype=np.uint8).tobytes())
  (d / "notes.md").write_bytes(b"# not text for the .txt pattern\n" * 10)
  return d


def _corpus_bytes(d, names):
  return b"".join((d / n).read_bytes() for n in names)


def test_batches_shape_and_determinism(corpus_dir):
  src = make_source("text", seq_len=SEQ, seed=1, path=str(corpus_dir), pattern="**/*.txt")
  assert src.vocab_size == 256 and src.seq_len == SEQ and not src.has_posterior
  assert [os.path.relpath(f, corpus_dir) for f in src.files] == ["a.txt", "b.txt", "sub/c.txt"]
  b = src.batch(3, 8)
  assert b["inputs"].shape == (8, SEQ) and b["inputs"].dtype == np.int32
  assert b["targets"].dtype == np.int32 and b["mask"].dtype == np.float32
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  assert np.all(b["mask"] == 1)
  again = make_source("text", seq_len=SEQ, seed=1, path=str(corpus_dir), pattern="**/*.txt")
  for k in b:
    np.testing.assert_array_equal(b[k], again.batch(3, 8)[k])
  other = make_source("text", seq_len=SEQ, seed=2, path=str(corpus_dir), pattern="**/*.txt")
  assert not np.array_equal(b["inputs"], other.batch(3, 8)["inputs"])
  # windows are real slices of the corpus (files in sorted order)
  corpus = _corpus_bytes(corpus_dir, ["a.txt", "b.txt", "sub/c.txt"])
  for row in np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1):
    assert corpus.find(row.astype(np.uint8).tobytes()) >= 0


def test_resume_mid_epoch_continues_the_same_batches(corpus_dir):
  kw = dict(seq_len=SEQ, seed=4, path=str(corpus_dir), pattern="**/*.txt")
  src = make_source("text", **kw)
  n_w = src.num_windows("train")
  steps = 2 * n_w // 8 + 3  # crosses at least two epoch boundaries
  straight = [src.batch(s, 8)["inputs"] for s in range(steps)]
  k = n_w // 8 // 2  # mid-epoch
  resumed = make_source("text", **kw)
  for s in range(k, steps):
    np.testing.assert_array_equal(resumed.batch(s, 8)["inputs"], straight[s])
  # one epoch = every train window exactly once
  starts = np.concatenate([src.window_starts(s, 1) for s in range(n_w)])
  np.testing.assert_array_equal(np.sort(starts), np.arange(n_w) * SEQ)
  assert src.epoch(n_w, 1) == 1 and src.epoch(n_w - 1, 1) == 0


def test_train_and_validation_windows_are_disjoint(corpus_dir):
  src = make_source(
    "text", seq_len=SEQ, seed=0, path=str(corpus_dir), pattern="**/*.txt", val_fraction=0.2
  )
  corpus = _corpus_bytes(corpus_dir, ["a.txt", "b.txt", "sub/c.txt"])
  n_train = src.num_bytes("train")
  assert n_train + src.num_bytes("validation") == len(corpus) == 4500
  assert n_train == 3600
  for split, lo, hi in (("train", 0, n_train), ("validation", n_train, len(corpus))):
    for s in range(6):
      b = src.batch(s, 8, split)
      for row in np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1):
        at = corpus.find(row.astype(np.uint8).tobytes())
        assert lo <= at and at + SEQ + 1 <= hi, (split, at)
  assert not np.array_equal(src.batch(0, 8)["inputs"], src.batch(0, 8, "validation")["inputs"])


def test_paths_globs_and_errors(tmp_path, corpus_dir):
  single = make_source("text", seq_len=SEQ, seed=0, path=str(corpus_dir / "a.txt"))
  assert single.files == [str(corpus_dir / "a.txt")]
  globbed = make_source("text", seq_len=SEQ, seed=0, path=str(corpus_dir / "*.txt"))
  assert len(globbed.files) == 2
  everything = make_source("text", seq_len=SEQ, seed=0, path=str(corpus_dir))
  assert len(everything.files) == 4
  missing = tmp_path / "no_such_dir"
  with pytest.raises(FileNotFoundError, match="no_such_dir"):
    make_source("text", seq_len=SEQ, seed=0, path=str(missing))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="empty"):
    make_source("text", seq_len=SEQ, seed=0, path=str(tmp_path / "empty"))
  with pytest.raises(FileNotFoundError, match=r"\*\.rst"):
    make_source("text", seq_len=SEQ, seed=0, path=str(corpus_dir / "*.rst"))
  with pytest.raises(ValueError, match="val_fraction"):
    make_source("text", seq_len=SEQ, seed=0, path=str(corpus_dir), val_fraction=1.5)
  with pytest.raises(ValueError, match="bogus"):
    make_source("text", seq_len=SEQ, seed=0, path=str(corpus_dir), bogus=1)
  tiny = make_source("text", seq_len=SEQ, seed=0, path=str(corpus_dir / "a.txt"), val_fraction=0.0)
  with pytest.raises(ValueError, match="validation"):
    tiny.batch(0, 2, "validation")
  with pytest.raises(ValueError, match="split"):
    tiny.batch(0, 2, "dev")


def test_default_corpus_is_the_standard_library():
  src = make_source("text", seq_len=64, seed=0, max_bytes=200_000)
  assert src.files and all(f.endswith(".py") for f in src.files)
  assert all(os.path.dirname(f) == stdlib_dir() for f in src.files)
  assert src.num_bytes("train") + src.num_bytes("validation") == 200_000
  b = src.batch(0, 4, "validation")
  assert b["inputs"].shape == (4, 64)


# ------------------------------------------------------------------------------- TFDS


def test_tfds_source_with_mock_data(tmp_path):
  # No skip: the `tfds` extra is part of the test environment; a missing install must fail.
  import tensorflow_datasets as tfds

  data_dir = str(tmp_path / "tfds")
  with tfds.testing.mock_data(num_examples=20):
    src = make_source("tfds", seq_len=SEQ, seed=0, name="tiny_shakespeare", data_dir=data_dir)
    ds = tfds.data_source("tiny_shakespeare", split="train", data_dir=data_dir, download=False)
    texts = [ds[i]["text"] for i in range(len(ds))]
    again = make_source("tfds", seq_len=SEQ, seed=0, name="tiny_shakespeare", data_dir=data_dir)
  corpus = "\n".join(t if isinstance(t, str) else t.decode() for t in texts).encode()
  assert src.vocab_size == 256 and not src.has_posterior
  assert src.num_bytes("train") == len(corpus) and src.num_bytes("validation") > 0
  b = src.batch(1, 4)
  assert b["inputs"].shape == (4, SEQ) and b["targets"].shape == (4, SEQ)
  assert b["inputs"].dtype == np.int32 and b["mask"].dtype == np.float32
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  for row in np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1):
    assert corpus.find(row.astype(np.uint8).tobytes()) >= 0
  for s in range(3):
    np.testing.assert_array_equal(src.batch(s, 4)["inputs"], again.batch(s, 4)["inputs"])
    np.testing.assert_array_equal(
      src.batch(s, 4, "validation")["inputs"], again.batch(s, 4, "validation")["inputs"]
    )

  # no validation split in TFDS terms: hold out the tail of train instead
  with tfds.testing.mock_data(num_examples=20):
    held = make_source(
      "tfds", seq_len=SEQ, seed=0, data_dir=data_dir, val_split=None, val_fraction=0.25
    )
  assert held.num_bytes("validation") == round(0.25 * len(corpus))


def test_tfds_missing_data_and_bad_options(tmp_path):
  import tensorflow_datasets  # noqa: F401  (fail, not skip, without the extra)

  with pytest.raises(FileNotFoundError, match="not prepared"):
    make_source("tfds", seq_len=SEQ, seed=0, data_dir=str(tmp_path / "empty_tfds"))
  with pytest.raises(ValueError, match="feature"):
    make_source("tfds", seq_len=SEQ, seed=0, feature="")
  with pytest.raises(ValueError, match="colour"):
    make_source("tfds", seq_len=SEQ, seed=0, colour="red")


def test_baseline_is_the_unigram_cross_entropy_of_the_scored_batches():
  """The trivial predictor's held-out loss, by hand: add-one training-split byte frequencies
  scored on exactly the validation windows the run's evaluation reads (batches 0..n-1)."""
  rng = np.random.default_rng(0)
  corpus = rng.choice(np.frombuffer(b"aab c", np.uint8), size=4000).astype(np.uint8)
  src = ByteWindows(corpus, seq_len=8, seed=3, val_fraction=0.25)
  counts = np.bincount(corpus[:3000], minlength=256) + 1.0
  logp = np.log(counts / counts.sum())
  t = np.concatenate([src.batch(i, 4, "validation")["targets"].ravel() for i in range(3)])
  assert src.baseline(4, 3) == pytest.approx(-logp[t].mean(), rel=1e-12)
  # 4 distinct bytes at frequencies ~(2, 1, 1, 1)/5 ('a' twice): near their entropy, far below
  # the uniform guess over 256 bytes
  h = -(0.4 * np.log(0.4) + 3 * 0.2 * np.log(0.2))
  assert abs(src.baseline(4, 3) - h) < 0.1 and src.baseline(4, 3) < np.log(256) - 3
  other = ByteWindows(corpus, seq_len=8, seed=4, val_fraction=0.25)  # other windows, other value
  assert other.baseline(4, 3) != src.baseline(4, 3)
