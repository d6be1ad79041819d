"""Raw text -> token store in three resumable stages: clean, deduplicate, tokenize.

    DIR/stages/clean/    normalised documents that passed the quality filters (part-*.jsonl.gz + stage.json)
    DIR/stages/dedup/    those left after exact and near-duplicate removal, plus clusters.jsonl.gz
    DIR/stages/run.json  what this directory is being built from (lets an interrupted run be resumed)
    DIR/{train,eval}/, DIR/tokenizer.model, DIR/manifest.json   the token store (see token_store.py; a Hugging
                                                                Face tokenizer is stored as DIR/tokenizer.json)

DIR/manifest.json is written last, so it exists only for a finished dataset; its extra.prepare section holds
the inputs (with content hashes), the config, and one section per stage (counts in/out, dropped by reason,
duplicate clusters, bytes, tokens, wall time, MB/s). A stage whose inputs and config are unchanged is skipped;
each stage commits by renaming a temporary directory, so an interrupted run resumes where it stopped.
A finished DIR is never modified: re-running with the same inputs and settings says it is up to date, with
different ones is an error (PrepareError), as is a non-empty DIR that prepare did not create.
"""
from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxllm.data import corpus
from jaxllm.data.clean import clean_documents
from jaxllm.data.dedup import find_duplicates
from jaxllm.data.prep_config import PrepConfig
from jaxllm.data.hf_tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, TOKENIZER_JSON
from jaxllm.data.stages import fingerprint, read_shards, run_stage, write_json_atomic, write_shards
from jaxllm.data.token_store import MANIFEST, TOKENIZER_FILE, TokenStore, write_token_store
from jaxllm.data.tokenizer import (AnyTokenizer, Tokenizer, find_tokenizer_file, iter_encoded_documents,
                                   load_tokenizer)

PREPARE_VERSION = 2
RUN_FILE = "run.json"
_CLEAN_BATCH = 1024  # documents cleaned together (the n-gram rules are batched with numpy)
_MIN_VOCAB = 256 + 4  # byte fallback needs every byte plus the 4 special ids


class PrepareError(Exception):
    """A user-facing problem with the inputs or the output directory (the CLI prints it as one line)."""


@dataclass(frozen=True)
class PrepareResult:
    output: Path
    up_to_date: bool
    manifest: dict
    seconds: float


def split_train_eval(texts: Sequence[str], eval_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic held-out split by a seeded hash of each document's text.

    Identical documents always land in the same split (no exact-duplicate leakage into eval). At least one
    document goes to each split.
    """
    if len(texts) < 2:
        raise PrepareError(f"need at least 2 documents to make a train/eval split, got {len(texts)}")

    def u(text: str) -> float:
        d = hashlib.blake2b(f"{seed}\0{text}".encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(d, "little") / 2.0**64

    scores = [u(t) for t in texts]
    is_eval = [s < eval_fraction for s in scores]
    if not any(is_eval):
        is_eval[min(range(len(texts)), key=scores.__getitem__)] = True
    if all(is_eval):
        is_eval[max(range(len(texts)), key=scores.__getitem__)] = False
    train = [t for t, e in zip(texts, is_eval) if not e]
    held = [t for t, e in zip(texts, is_eval) if e]
    return train, held


def _check_output(output: Path, fp: str, inputs_fp: str) -> str:
    """'done' (this exact dataset is there), 'resume' (an unfinished run of these inputs) or 'fresh'.

    Raises PrepareError, touching nothing, for anything else.
    """
    if not output.exists():
        return "fresh"
    if not output.is_dir():
        raise PrepareError(f"output {output} is a file; expected a directory for the token store")
    if not any(output.iterdir()):
        return "fresh"
    if (output / MANIFEST).is_file():
        try:
            manifest = TokenStore.open(output).manifest
        except (FileNotFoundError, ValueError) as e:
            raise PrepareError(str(e)) from None
        if manifest.get("extra", {}).get("prepare", {}).get("fingerprint") == fp:
            return "done"
        raise PrepareError(f"output {output} holds a token store built from different inputs or settings; "
                           "remove it or choose another output directory")
    try:
        run = json.loads((output / "stages" / RUN_FILE).read_text())
    except (OSError, ValueError):
        raise PrepareError(f"output {output} is not empty and holds no token store ({MANIFEST} missing); "
                           "expected an empty directory or one written by prepare_data") from None
    if run.get("inputs_fingerprint") != inputs_fp:
        raise PrepareError(f"output {output} holds an unfinished preparation of different inputs; "
                           "remove it or choose another output directory")
    return "resume"


def _clean_stage(files: list[Path], cfg: PrepConfig, log) -> Callable[[Path], dict]:
    def build(out: Path) -> dict:
        stats = corpus.ReadStats()
        dropped: collections.Counter = collections.Counter()
        kept: list[tuple[str, str]] = []

        def flush(batch):
            for (doc_id, _), (text, reason) in zip(batch, clean_documents([t for _, t in batch], cfg.clean)):
                if reason is None:
                    kept.append((doc_id, text))
                else:
                    dropped[reason] += 1

        batch: list[tuple[str, str]] = []
        for rec in corpus.iter_documents(files, stats, txt_split=cfg.read.txt_split,
                                         max_invalid_utf8_fraction=cfg.clean.max_invalid_utf8_fraction):
            batch.append(rec)
            if len(batch) >= _CLEAN_BATCH:
                flush(batch)
                batch = []
        flush(batch)
        n_out, bytes_out = write_shards(out, kept)
        read = stats.to_dict()
        all_dropped = collections.Counter(read["dropped"]) + dropped
        return {"docs_in": read["docs"] + sum(read["dropped"].values()), "docs_out": n_out,
                "dropped": dict(sorted(all_dropped.items())), "repaired_docs": read["repaired_docs"],
                "files_read": read["files_read"], "skipped_files": read["skipped_files"],
                "bytes_in": read["bytes_in"], "bytes_out": bytes_out}
    return build


def _dedup_stage(clean_dir: Path, cfg: PrepConfig) -> Callable[[Path], dict]:
    def build(out: Path) -> dict:
        ids, texts = [], []
        for doc_id, text in read_shards(clean_dir):
            ids.append(doc_id)
            texts.append(text)
        d = cfg.dedup
        res = find_duplicates(texts, exact=d.exact, near=d.near, ngram=d.ngram, num_perm=d.num_perm,
                              bands=d.bands, threshold=d.threshold, seed=d.seed)
        n_out, bytes_out = write_shards(out, ((ids[i], texts[i]) for i in range(len(texts)) if res.keep[i]))
        named = [{"kind": c["kind"], "kept": ids[c["kept"]], "removed": [ids[r] for r in c["removed"]]}
                 for c in res.clusters]
        # The full cluster list can be long: it goes to its own file, the first few to the manifest.
        with gzip.open(out / "clusters.jsonl.gz", "wt", encoding="utf-8", compresslevel=1) as f:
            for c in named:
                f.write(json.dumps(c) + "\n")
        dropped = collections.Counter(r for r in res.reason if r)
        return {"docs_in": len(texts), "docs_out": n_out, "dropped": dict(sorted(dropped.items())),
                "clusters": {"exact": sum(c["kind"] == "exact" for c in named),
                             "near": sum(c["kind"] == "near" for c in named),
                             "examples": named[:10], "file": "stages/dedup/clusters.jsonl.gz"},
                "bytes_in": sum(len(t.encode("utf-8")) for t in texts), "bytes_out": bytes_out}
    return build


def _tokenize_stage(output: Path, dedup_dir: Path, vocab_size: int | None,
                    given: tuple[Path, AnyTokenizer] | None, eval_fraction: float, seed: int, log) -> Callable[[Path], dict]:
    def build(tmp: Path) -> dict:
        texts = [t for _, t in read_shards(dedup_dir)]
        train, held = split_train_eval(texts, eval_fraction, seed)
        t0 = time.perf_counter()
        if given is None:
            model = tmp / TOKENIZER_FILE
            try:
                tok = Tokenizer.train(train, model, vocab_size)
            except ValueError as e:
                raise PrepareError(str(e)) from None
            log(f"trained tokenizer: vocab {tok.vocab_size} ({time.perf_counter() - t0:.1f}s)")
        else:
            model, tok = given  # write_token_store copies it (and a tokenizer.json's config files)
        train_seconds = time.perf_counter() - t0
        store = tmp / "store"
        manifest = write_token_store(
            store, {"train": iter_encoded_documents(tok, train), "eval": iter_encoded_documents(tok, held)},
            tokenizer_path=model, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
            pad_id=tok.pad_id)
        # Publish the splits and tokenizer files into DIR (no manifest.json there yet, so no reader can see them
        # half-moved), first removing the tokenizer files an interrupted run with another tokenizer may have left.
        for stale in (TOKENIZER_FILE, TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE):
            (output / stale).unlink(missing_ok=True)
        for name in sorted(p.name for p in store.iterdir() if p.name != MANIFEST):
            dst = output / name
            if dst.is_dir():
                shutil.rmtree(dst)
            elif dst.exists():
                dst.unlink()
            os.rename(store / name, dst)
        write_json_atomic(tmp / "store_manifest.json", manifest)
        shutil.rmtree(store)  # now only its manifest copy is left
        if given is None:
            model.unlink()
        s = manifest["splits"]
        return {"docs_in": len(texts), "docs_out": s["train"]["num_docs"] + s["eval"]["num_docs"],
                "train": s["train"], "eval": s["eval"], "vocab_size": tok.vocab_size,
                "tokenizer_train_seconds": round(train_seconds, 3),
                "tokens": s["train"]["num_tokens"] + s["eval"]["num_tokens"],
                "bytes_in": sum(len(t.encode("utf-8")) for t in texts)}
    return build


def prepare(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    eval_fraction: float = 0.02,
    seed: int = 0,
    config: PrepConfig | None = None,
    log: Callable[[str], None] = print,
) -> PrepareResult:
    """Build (or resume, or confirm) the dataset in `output` from raw inputs (see module docstring).

    `tokenizer` (instead of training one with `vocab_size`) is a sentencepiece `.model` file, a Hugging Face
    `tokenizer.json` (with the tokenizer_config.json beside it, if any) or a directory holding one of them.

    Raises PrepareError for user-facing problems; bad input files are skipped and reported, not raised.
    """
    t0 = time.perf_counter()
    output = Path(output)
    cfg = config or PrepConfig()
    if (vocab_size is None) == (tokenizer is None):
        raise PrepareError("give exactly one of --vocab_size (train a tokenizer) or --tokenizer FILE")
    if vocab_size is not None and vocab_size < _MIN_VOCAB:
        raise PrepareError(f"vocab_size {vocab_size} is too small: byte-fallback BPE needs at least {_MIN_VOCAB} "
                           "(256 bytes + 4 special ids) plus the corpus's characters")
    if not 0.0 < eval_fraction < 1.0:
        raise PrepareError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    tok_path, given = Path(tokenizer) if tokenizer is not None else None, None
    if tok_path is not None:  # loaded before any stage runs, so a bad tokenizer fails at once
        if tok_path.is_dir() and find_tokenizer_file(tok_path) is not None:
            tok_path = find_tokenizer_file(tok_path)
        try:
            given = (tok_path, load_tokenizer(tok_path))
        except (FileNotFoundError, ValueError) as e:
            raise PrepareError(str(e)) from None
    try:
        files = corpus.list_input_files(inputs)
    except (FileNotFoundError, ValueError) as e:
        raise PrepareError(str(e)) from None
    described = corpus.describe_inputs(files)
    inputs_fp = fingerprint([(Path(d["path"]).name, d["sha256"]) for d in described])
    settings = {"version": PREPARE_VERSION, "config": cfg.to_dict(), "vocab_size": vocab_size,
                "tokenizer_sha256": hashlib.sha256(given[1].model_proto).hexdigest() if given else None,
                "eval_fraction": eval_fraction, "seed": seed}
    fp = fingerprint({"inputs": inputs_fp, **settings})
    state = _check_output(output, fp, inputs_fp)
    if state == "done":
        return PrepareResult(output, True, TokenStore.open(output).manifest, time.perf_counter() - t0)
    stages_root = output / "stages"
    stages_root.mkdir(parents=True, exist_ok=True)
    if state == "fresh":
        write_json_atomic(stages_root / RUN_FILE, {"inputs_fingerprint": inputs_fp, "inputs": described})

    def report(name, section, skipped):
        if skipped:
            log(f"{name}: up to date (skipped)")
            return
        drops = ", ".join(f"{k} {v}" for k, v in section.get("dropped", {}).items()) or "none"
        log(f"{name}: {section['docs_in']} -> {section['docs_out']} documents (dropped: {drops}) "
            f"in {section['seconds']:.1f}s, {section['mb_per_s']:.1f} MB/s")

    sections = {}
    clean_fp = fingerprint({"v": PREPARE_VERSION, "inputs": inputs_fp, "read": cfg.to_dict()["read"],
                            "clean": cfg.to_dict()["clean"]})
    sections["clean"], skipped = run_stage(stages_root, "clean", clean_fp, _clean_stage(files, cfg, log))
    report("clean", sections["clean"], skipped)
    for f in sections["clean"]["skipped_files"]:
        log(f"  skipped {f['path']}: {f['reason']}")
    if sections["clean"]["docs_out"] < 2:
        raise PrepareError(f"only {sections['clean']['docs_out']} usable document(s) in the inputs after cleaning "
                           f"(dropped: {sections['clean']['dropped']}, skipped files: "
                           f"{len(sections['clean']['skipped_files'])}); need at least 2")

    dedup_fp = fingerprint({"clean": clean_fp, "dedup": cfg.to_dict()["dedup"]})
    sections["dedup"], skipped = run_stage(stages_root, "dedup", dedup_fp, _dedup_stage(stages_root / "clean", cfg))
    report("dedup", sections["dedup"], skipped)

    tok_fp = fingerprint({"dedup": dedup_fp, **{k: v for k, v in settings.items() if k != "config"}})
    sections["tokenize"], skipped = run_stage(
        stages_root, "tokenize", tok_fp,
        _tokenize_stage(output, stages_root / "dedup", vocab_size, given, eval_fraction, seed, log))
    report("tokenize", sections["tokenize"], skipped)

    manifest = json.loads((stages_root / "tokenize" / "store_manifest.json").read_text())
    manifest["extra"] = {"prepare": {
        "fingerprint": fp, "inputs": described, "vocab_size_requested": vocab_size,
        "tokenizer_source": str(tok_path) if tok_path else "trained", "eval_fraction": eval_fraction,
        "seed": seed, "config": cfg.to_dict(), "stages": sections,
    }}
    write_json_atomic(output / MANIFEST, manifest)  # the commit point of the whole dataset
    seconds = time.perf_counter() - t0
    s = manifest["splits"]
    log(f"wrote {output}: train {s['train']['num_docs']} docs / {s['train']['num_tokens']} tokens, "
        f"eval {s['eval']['num_docs']} docs / {s['eval']['num_tokens']} tokens in {seconds:.1f}s")
    return PrepareResult(output, False, manifest, seconds)
