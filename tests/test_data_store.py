"""Token store write/open/read, atomic overwrite refusal, clear errors; the prepare_data CLI end to end."""
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxllm.data.clean import normalize
from jaxllm.data.token_store import TokenStore, write_token_store
from jaxllm.data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _docs(seed, n, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=rng.integers(0, 50)).astype(np.int64) for _ in range(n)]


def _write(path, splits, vocab=1000, tokenizer=None, extra=None):
    if tokenizer is None:
        tokenizer = path.parent / "dummy.model"
        tokenizer.write_bytes(b"tokenizer bytes")
    return write_token_store(path, splits, tokenizer_path=tokenizer, vocab_size=vocab,
                             bos_id=2, eos_id=3, pad_id=0, extra_manifest=extra)


def test_write_open_read(tmp_path):
    train, held = _docs(0, 300), _docs(1, 5)
    _write(tmp_path / "s", {"train": iter(train), "eval": held}, extra={"note": "x"})
    store = TokenStore.open(tmp_path / "s")
    m = store.manifest
    assert m["vocab_size"] == 1000 and m["dtype"] == "uint16" and m["extra"] == {"note": "x"}
    assert (tmp_path / "s" / "tokenizer.model").read_bytes() == b"tokenizer bytes"
    sp = store.split("train")
    stream = np.concatenate(train)
    assert (sp.num_docs, sp.num_tokens) == (300, len(stream)) == (m["splits"]["train"]["num_docs"], m["splits"]["train"]["num_tokens"])
    assert sp.doc_offsets.dtype == np.int64 and len(sp.doc_offsets) == 301
    for i in (0, 7, 299):
        np.testing.assert_array_equal(sp.doc(i), train[i])
    got = sp.read(5, 4000)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, stream[5:4000])
    np.testing.assert_array_equal(store.split("eval").read(0, store.split("eval").num_tokens), np.concatenate(held))
    # Picklable for grain workers, and usable after unpickling (handles reopen lazily).
    sp2 = pickle.loads(pickle.dumps(sp))
    np.testing.assert_array_equal(sp2.read(100, 200), stream[100:200])
    with pytest.raises(IndexError):
        sp.read(0, sp.num_tokens + 1)
    with pytest.raises(ValueError, match="no split 'test'"):
        store.split("test")
    assert not list(tmp_path.glob("s.tmp-*"))


def test_large_vocab_uses_int32_and_multichunk(tmp_path):
    docs = [np.arange(70_000) * 3 % 100_000, np.array([99_999])]
    _write(tmp_path / "s", {"train": docs}, vocab=100_000)
    sp = TokenStore.open(tmp_path / "s").split("train")
    assert TokenStore.open(tmp_path / "s").manifest["dtype"] == "int32"
    np.testing.assert_array_equal(sp.read(0, sp.num_tokens), np.concatenate(docs))


def test_rejects_out_of_range_ids(tmp_path):
    with pytest.raises(ValueError, match="document 1"):
        _write(tmp_path / "s", {"train": [[5], [1000]]})
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob("s.tmp-*"))


def test_refuses_to_overwrite_a_different_directory(tmp_path):
    docs = _docs(0, 20)
    _write(tmp_path / "s", {"train": docs})
    before = (tmp_path / "s" / "manifest.json").read_bytes()
    _write(tmp_path / "s", {"train": docs})  # identical content: a no-op
    with pytest.raises(FileExistsError, match="refusing to overwrite .*s"):
        _write(tmp_path / "s", {"train": _docs(1, 20)})
    assert (tmp_path / "s" / "manifest.json").read_bytes() == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        _write(tmp_path / "other", {"train": docs})
    assert (tmp_path / "other" / "keep.txt").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty", {"train": docs})  # an empty directory may be filled
    assert TokenStore.open(tmp_path / "empty").split("train").num_docs == 20
    assert not list(tmp_path.glob("*.tmp-*"))


def test_missing_and_corrupt_stores(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere.*manifest\.json"):
        TokenStore.open(tmp_path / "nowhere")
    _write(tmp_path / "s", {"train": _docs(0, 20)})
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "s", bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.*manifest\.json.*JSON"):
        TokenStore.open(bad)
    (bad / "manifest.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a token store manifest"):
        TokenStore.open(bad)
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(bad / "train" / "doc_offsets")
    with pytest.raises(ValueError, match=r"bad.*train/doc_offsets.*expected"):
        TokenStore.open(bad).split("train")
    m["splits"]["train"]["num_docs"] += 1
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="inconsistent with the manifest"):
        TokenStore.open(tmp_path / "s").split("train")


# ---- scripts/prepare_data.py, run as the user would ------------------------------------------------

def _cli(*args):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def tiny_corpus(tmp_path):
    src = tmp_path / "raw"
    (src / "sub").mkdir(parents=True)
    texts = [f"Document {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog.\n\nLine two {i}.\n"
             for i in range(40)]
    with open(src / "a.jsonl", "w") as f:
        for t in texts[:30]:
            f.write(json.dumps({"id": t[:12], "text": t}) + "\n")
    for i, t in enumerate(texts[30:]):
        (src / "sub" / f"{i}.txt").write_text(t)
    return src, texts


def test_prepare_cli(tmp_path, tiny_corpus):
    src, texts = tiny_corpus
    out = tmp_path / "store"
    # The tiny test documents would fail the quality filters (too short, repetitive): only normalise.
    rc, stdout, stderr = _cli("--input", src, "--output", out, "--vocab_size", 400, "--eval_fraction", 0.1,
                              "--clean.filters=false")
    assert rc == 0, stderr
    assert "wrote" in stdout and "tokens" in stdout
    store = TokenStore.open(out)
    tok = Tokenizer.load(store.tokenizer_path)
    train, held = store.split("train"), store.split("eval")
    assert train.num_docs + held.num_docs == 40 and held.num_docs >= 1
    got = [tok.decode(sp.doc(i)) for sp in (train, held) for i in range(sp.num_docs)]
    assert sorted(got) == sorted(normalize(t) for t in texts)
    assert all(sp.doc(i)[0] == 2 and sp.doc(i)[-1] == 3 for sp in (train, held) for i in range(sp.num_docs))

    manifest = (out / "manifest.json").read_bytes()
    rc, stdout, stderr = _cli("--input", src, "--output", out, "--vocab_size", 400, "--eval_fraction", 0.1,
                              "--clean.filters=false")
    assert rc == 0 and "up to date" in stdout, stderr
    assert (out / "manifest.json").read_bytes() == manifest

    # Same output, different arguments: refuse, touch nothing.
    rc, stdout, stderr = _cli("--input", src, "--output", out, "--vocab_size", 420)
    assert rc == 2 and stderr.startswith("error: ") and str(out) in stderr and len(stderr.strip().splitlines()) == 1
    assert (out / "manifest.json").read_bytes() == manifest

    # An existing tokenizer can be reused instead of training.
    rc, _, stderr = _cli("--input", src, "--output", tmp_path / "s2", "--tokenizer", store.tokenizer_path,
                         "--clean.filters=false")
    assert rc == 0, stderr
    assert (tmp_path / "s2" / "tokenizer.model").read_bytes() == store.tokenizer_path.read_bytes()


def test_prepare_cli_errors(tmp_path, tiny_corpus):
    src, _ = tiny_corpus
    rc, stdout, stderr = _cli("--input", tmp_path / "missing.jsonl", "--output", tmp_path / "o", "--vocab_size", 300)
    assert rc == 2 and stderr.startswith("error: ") and "missing.jsonl" in stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert not (tmp_path / "o").exists()

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    rc, stdout, stderr = _cli("--input", src, "--output", other, "--vocab_size", 300)
    assert rc == 2 and stderr.startswith("error: ") and str(other) in stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert [p.name for p in other.iterdir()] == ["notes.txt"] and (other / "notes.txt").read_text() == "mine"


def test_prepare_cli_vocab_too_small(tmp_path, tiny_corpus):
    src, _ = tiny_corpus
    rc, _, stderr = _cli("--input", src, "--output", tmp_path / "o", "--vocab_size", 100)
    assert rc == 2 and stderr.startswith("error: ") and "vocab_size 100" in stderr
    assert len(stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
