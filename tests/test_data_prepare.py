"""Preparation stages: normalisation, each quality filter, exact/near dedup, manifest accounting, re-run skips,
interrupted-run resume, bad inputs, and the config overrides."""
import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxllm.config.cli import split_overrides
from jaxllm.config.schema import ConfigError
from jaxllm.data import prepare as prepare_mod
from jaxllm.data.clean import clean_document, normalize, quality_reason
from jaxllm.data.dedup import find_duplicates, near_duplicate_pairs
from jaxllm.data.prep_config import CleanConfig, load_config
from jaxllm.data.prepare import PrepareError, prepare
from jaxllm.data.token_store import TokenStore
from jaxllm.data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "data" / "shakespeare.jsonl.gz"
QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def plays():
    with gzip.open(SHAKESPEARE, "rt") as f:
        return [json.loads(line)["text"] for _, line in zip(range(60), f)]


# ---- normalisation and filters ------------------------------------------------------------------------

def test_normalize():
    raw = "Cafe\u0301\r\nline\u00a0two\t \r\rthird\x07 line\u200b\n\n\n\n  indented   \n"
    assert normalize(raw) == "Caf\u00e9\nline two\n\nthird line\n\n  indented"
    assert normalize("\ufeffx") == "x"


PROSE = ("The history of the town is long and it is full of the kind of detail that a careful reader will "
         "enjoy. It was founded by farmers who came to the valley with their families and their animals, and "
         "they built houses of stone along the river where the land was good for growing wheat and barley. ")


@pytest.mark.parametrize("text,reason", [
    ("Too short to keep.", "too_short_chars"),
    ("word " * 30, "too_few_words"),
    (PROSE + "x" * 2000, "mean_word_length"),
    (PROSE + " ".join(["12345 678 99"] * 40), "alpha_words"),
    (PROSE + "#tag " * 12, "symbol_word_ratio"),
    (PROSE + "\n" + "\n".join(["same line here"] * 40), "dup_lines"),
    ("\n".join(f"\u2022 {w} is one more item in this list of things" for w in PROSE.split()[:30]), "bullet_lines"),
    (PROSE + " ".join(["buy cheap pills now"] * 30), "top_2gram"),
    (PROSE + PROSE + PROSE, "dup_5gram"),
])
def test_each_filter(text, reason):
    assert quality_reason(normalize(text), CleanConfig()) == reason
    assert quality_reason(normalize(PROSE), CleanConfig()) is None


def test_language_filter_and_switches():
    no_rep = dict(max_dup_ngram_char_fraction=None, max_top_ngram_char_fraction=None)
    german = ("Die Geschichte der Stadt ist lang und voller Einzelheiten, die ein sorgfaeltiger Leser "
              "geniessen wird. Sie wurde von Bauern gegruendet, die mit ihren Familien und Tieren in das Tal "
              "kamen und Steinhaeuser entlang des Flusses bauten, wo der Boden gut fuer Weizen war. ") * 2
    assert quality_reason(normalize(german), CleanConfig(**no_rep)) is None  # language filter is off by default
    assert quality_reason(normalize(german), CleanConfig(language="en", **no_rep)) == "language"
    assert quality_reason(normalize(PROSE), CleanConfig(language="en")) is None
    assert clean_document("short", CleanConfig(filters=False)) == ("short", None)


def test_shakespeare_passes_default_filters(plays):
    assert all(clean_document(t, CleanConfig())[1] is None for t in plays)


def test_config_overrides(tmp_path):
    _, overrides = split_overrides(["--clean.min_words=20", "--dedup.threshold", "0.7", "--clean.language=en",
                                    "--clean.max_top_ngram_char_fraction=0.3,0.3,0.3", "--clean.max_chars=none"],
                                   prefix="--")
    cfg = load_config(None, overrides)
    assert (cfg.clean.min_words, cfg.dedup.threshold, cfg.clean.language) == (20, 0.7, "en")
    assert cfg.clean.max_top_ngram_char_fraction == (0.3, 0.3, 0.3) and cfg.clean.max_chars is None
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"dedup": {"bands": 32}}))
    assert load_config(f, [("dedup.num_perm", "64")]).dedup.bands == 32
    for key, text, match in [("clean.nope", "1", "^clean.nope: unknown key; expected one of "),
                             ("x.y", "1", r"^x: unknown section; expected one of \['clean', 'dedup', 'read'\]"),
                             ("clean.min_words", "abc", "^clean.min_words: expected an integer, got 'abc'"),
                             ("dedup.bands", "7", "^dedup.num_perm: 128 must be a positive multiple of dedup.bands=7"),
                             ("clean", "1", "^clean: expected a section of values, got '1'")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [(key, text)])


# ---- deduplication --------------------------------------------------------------------------------------

def _perturb(text, n, seed):
    rng = random.Random(seed)
    words = text.split(" ")
    for _ in range(n):
        words[rng.randrange(len(words))] = rng.choice(["zounds", "prithee", "forsooth"])
    return " ".join(words)


def test_exact_and_near_duplicates(plays):
    docs = plays[:40]
    texts = docs + [_perturb(docs[i], 4, i) for i in range(5)] + [docs[7], docs[7]]
    res = find_duplicates(texts)
    removed = set(np.flatnonzero(~res.keep).tolist())
    assert removed == set(range(40, 47))  # every planted copy goes, every original stays
    assert [res.reason[i] for i in (40, 45, 46)] == ["near_duplicate", "exact_duplicate", "exact_duplicate"]
    exact = [c for c in res.clusters if c["kind"] == "exact"]
    assert exact == [{"kind": "exact", "kept": 7, "removed": [45, 46]}]
    # Deterministic: the copy that comes first is kept, whichever it is.
    res2 = find_duplicates([texts[40]] + docs)
    assert res2.keep[0] and not res2.keep[1] and res2.keep[2:].all()
    # Heavily edited copies (far below the threshold) are distinct documents.
    assert find_duplicates(docs[:5] + [_perturb(docs[0], 400, 0)]).keep.all()


def test_agreement_with_datasketch(plays):
    datasketch = pytest.importorskip("datasketch")
    from jaxllm.data.dedup import Shingler
    rng = random.Random(1)
    # Planted copies clearly above (1-6 words changed, Jaccard ~0.9+) or below (60-90 changed) the threshold:
    # right at it, any two MinHash estimates (std ~0.035 with 128 permutations) disagree by chance.
    edits = [rng.randrange(1, 7) for _ in range(20)] + [rng.randrange(60, 90) for _ in range(10)]
    texts = plays + [_perturb(plays[rng.randrange(60)], n, i) for i, n in enumerate(edits)]
    ours = set(np.flatnonzero(~find_duplicates(texts, exact=False).keep).tolist())
    lsh = datasketch.MinHashLSH(threshold=0.8, num_perm=128)
    sh = Shingler(5)
    theirs, sigs = set(), []
    for i, t in enumerate(texts):
        m = datasketch.MinHash(num_perm=128)
        m.update_batch([int(x).to_bytes(8, "little") for x in sh(t)])
        if any(sigs[j].jaccard(m) >= 0.8 for j in lsh.query(m)):
            theirs.add(i)
        else:
            lsh.insert(i, m)
        sigs.append(m)
    assert len(theirs) >= 15
    assert len(ours & theirs) / len(ours | theirs) >= 0.9


# ---- prepare: stages, manifest, re-run, resume, bad input ------------------------------------------------

@pytest.fixture
def raw(tmp_path, plays):
    src = tmp_path / "raw"
    src.mkdir()
    with gzip.open(src / "a.jsonl.gz", "wt") as f:
        for t in plays[:30]:
            f.write(json.dumps({"text": t}) + "\n")
        f.write(json.dumps({"text": plays[3]}) + "\n")                      # exact duplicate
        f.write(json.dumps({"text": _perturb(plays[4], 3, 0)}) + "\n")      # near duplicate
        f.write(json.dumps({"text": "tiny"}) + "\n")                         # too short
        f.write("{not json\n")                                               # malformed record
    (src / "b.txt").write_text(plays[30] + "\n\n\n" + plays[31])            # one document per .txt file
    (src / "latin.txt").write_bytes(plays[32].encode() + b"\xe9\xff" + b" more")  # two bad bytes: repaired
    (src / "empty.jsonl").write_text("")
    (src / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
    (src / "utf16.txt").write_bytes(plays[33].encode("latin-1").decode().encode("cp500"))  # EBCDIC: not UTF-8
    return src


def _run(raw, out, **kw):
    return prepare([raw], out, vocab_size=400, **QUIET, **kw)


def test_prepare_stages_manifest_and_rerun(tmp_path, raw):
    out = tmp_path / "ds"
    r = _run(raw, out)
    st = r.manifest["extra"]["prepare"]["stages"]
    clean, dedup, tok = st["clean"], st["dedup"], st["tokenize"]
    skipped = {Path(f["path"]).name: f["reason"] for f in clean["skipped_files"]}
    assert set(skipped) == {"empty.jsonl", "blob.txt", "utf16.txt"}
    assert skipped["empty.jsonl"] == "empty" and "binary" in skipped["blob.txt"] and "UTF-8" in skipped["utf16.txt"]
    assert clean["dropped"] == {"malformed_record": 1, "too_short_chars": 1} and clean["repaired_docs"] == 1
    assert clean["docs_in"] == 30 + 3 + 1 + 1 + 1 and clean["docs_out"] == clean["docs_in"] - 2
    assert dedup["docs_in"] == clean["docs_out"]
    assert dedup["dropped"] == {"exact_duplicate": 1, "near_duplicate": 1}
    assert dedup["docs_out"] == dedup["docs_in"] - 2 == tok["docs_in"] == tok["docs_out"]
    assert dedup["clusters"]["exact"] == 1 and dedup["clusters"]["near"] == 1
    # Each stage reads what the one before it wrote, and its MB/s is its bytes over its time.
    assert dedup["bytes_in"] == clean["bytes_out"] and tok["bytes_in"] == dedup["bytes_out"]
    assert 0 < tok["bytes_in"] < dedup["bytes_in"] < clean["bytes_in"]
    for s in st.values():  # seconds and MB/s are rounded to 3 decimals, MB/s from the unrounded time
        mb, low, high = s["bytes_in"] / 1e6, s["seconds"] + 5e-4, max(s["seconds"] - 5e-4, 1e-9)
        assert s["seconds"] >= 0 and mb / low - 1e-3 <= s["mb_per_s"] <= mb / high + 1e-3, s
    assert tok["tokens"] == r.manifest["splits"]["train"]["num_tokens"] + r.manifest["splits"]["eval"]["num_tokens"]
    assert {i["path"] for i in r.manifest["extra"]["prepare"]["inputs"]} == {str(p) for p in raw.iterdir()}
    store = TokenStore.open(out)
    assert store.split("train").num_docs + store.split("eval").num_docs == tok["docs_out"]
    tk = Tokenizer.load(store.tokenizer_path)
    assert "\ufffd" in "".join(tk.decode(store.split(s).doc(i)) for s in ("train", "eval")
                               for i in range(store.split(s).num_docs))  # the repaired document is in
    before = (out / "manifest.json").read_bytes()
    again = _run(raw, out)
    assert again.up_to_date and (out / "manifest.json").read_bytes() == before
    with pytest.raises(PrepareError, match="different inputs or settings"):
        _run(raw, out, config=load_config(None, [("dedup.threshold", "0.5")]))
    assert (out / "manifest.json").read_bytes() == before


def test_interrupted_run_resumes(tmp_path, raw, monkeypatch):
    out = tmp_path / "ds"

    def boom(*a, **k):
        raise RuntimeError("simulated crash in dedup")
    monkeypatch.setattr(prepare_mod, "find_duplicates", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        _run(raw, out)
    monkeypatch.undo()
    assert (out / "stages" / "clean" / "stage.json").is_file()
    assert not (out / "stages" / "dedup").exists() and not (out / "manifest.json").exists()
    assert not list((out / "stages").glob(".*tmp*"))
    clean_before = (out / "stages" / "clean" / "stage.json").read_bytes()
    logs = []
    r = prepare([raw], out, vocab_size=400, log=logs.append)
    assert "clean: up to date (skipped)" in logs and not r.up_to_date
    assert (out / "stages" / "clean" / "stage.json").read_bytes() == clean_before
    assert TokenStore.open(out).split("train").num_docs > 0
    # A changed dedup setting on an unfinished run re-runs dedup only.
    (out / "manifest.json").unlink()
    logs.clear()
    prepare([raw], out, vocab_size=400, log=logs.append, config=load_config(None, [("dedup.near", "false")]))
    assert "clean: up to date (skipped)" in logs and not any(l.startswith("dedup: up to date") for l in logs)


def _cli(*args):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_errors_are_one_line(tmp_path, raw):
    cases = [
        (["--input", tmp_path / "missing", "--output", tmp_path / "o1", "--vocab_size", 400], "missing"),
        (["--input", raw, "--output", tmp_path / "o2", "--vocab_size", 400, "--clean.bogus=1"], "clean.bogus"),
        (["--input", raw, "--output", tmp_path / "o3", "--vocab_size", 400, "--data_config", tmp_path / "no.json"], "no.json"),
        (["--input", tmp_path / "raw" / "empty.jsonl", "--output", tmp_path / "o4", "--vocab_size", 400], "usable"),
    ]
    for args, needle in cases:
        rc, _, err = _cli(*args)
        assert rc == 2 and err.startswith("error: ") and needle in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for o in ("o1", "o2", "o3"):
        assert not (tmp_path / o).exists()
    # An unfinished preparation of other inputs is foreign too: refused, untouched.
    other = tmp_path / "raw2"
    other.mkdir()
    (other / "x.txt").write_text(PROSE * 3)
    rc, _, err = _cli("--input", other, "--output", tmp_path / "o4", "--vocab_size", 400)
    assert rc == 2 and "different inputs" in err



def _signatures_by_hand() -> np.ndarray:
    """Four 128-row signatures (16 bands of 8 rows): B shares only the last band with A; C agrees with A on rows
    0-95 (bands 0-11: a candidate, at 0.75 below the 0.8 threshold); D agrees with A on rows 0-109 (0.86)."""
    rng = np.random.default_rng(0)
    sig = rng.choice(2**31, size=(4, 128), replace=False).astype(np.uint32)  # no row equal by chance
    a, b, c, d = sig
    b[120:] = a[120:]
    c[:96] = a[:96]
    d[:110] = a[:110]
    return sig


@pytest.mark.parametrize("threshold,pairs", [
    (0.8, [[0, 3]]),  # C collides with A but agrees too little; B agrees too little
    (0.7, [[0, 2], [0, 3], [2, 3]]),  # C and D agree on rows 0-95 too
    (0.06, [[0, 1], [0, 2], [0, 3], [2, 3]]),  # B: 8 of 128 rows, found through the last band alone
])
def test_near_duplicates_of_hand_made_signatures(threshold, pairs):
    assert near_duplicate_pairs(_signatures_by_hand(), bands=16, threshold=threshold).tolist() == pairs
