"""Raw text -> token store: read, split train/eval, train (or load) the tokenizer, tokenize, write.

Each stage is a separate function so cleaning/dedup stages can be slotted in between reading and splitting.
A store records a fingerprint of its inputs and arguments; re-running with the same ones is a no-op.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxllm.data import corpus
from jaxllm.data.token_store import MANIFEST, TokenStore, write_token_store
from jaxllm.data.tokenizer import Tokenizer, iter_encoded_documents

PREPARE_VERSION = 1


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


def _fingerprint(files: list[Path], vocab_size: int | None, tokenizer: Path | None,
                 eval_fraction: float, seed: int) -> str:
    args = {
        "version": PREPARE_VERSION,
        "inputs": corpus.fingerprint_files(files),
        "vocab_size": vocab_size,
        "tokenizer_sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest() if tokenizer else None,
        "eval_fraction": eval_fraction,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()


def _check_output(output: Path, fingerprint: str) -> bool:
    """True if output already holds this exact dataset; raise PrepareError if it holds anything else."""
    if not output.exists():
        return False
    if not output.is_dir():
        raise PrepareError(f"output {output} is a file; expected a directory for the token store")
    if not any(output.iterdir()):
        return False
    if not (output / MANIFEST).is_file():
        raise PrepareError(f"output {output} is not empty and holds no token store ({MANIFEST} missing); "
                           "expected an empty directory or one written by prepare_data")
    try:
        manifest = TokenStore.open(output).manifest
    except (FileNotFoundError, ValueError) as e:
        raise PrepareError(str(e)) from None
    if manifest.get("extra", {}).get("prepare", {}).get("fingerprint") == fingerprint:
        return True
    raise PrepareError(f"output {output} holds a token store built from different inputs or arguments; "
                       "remove it or choose another output directory")


def prepare(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    eval_fraction: float = 0.02,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> PrepareResult:
    """Build a token store in `output` from raw text inputs (see module docstring). Raises PrepareError."""
    t0 = time.perf_counter()
    output = Path(output)
    if (vocab_size is None) == (tokenizer is None):
        raise PrepareError("give exactly one of --vocab_size (train a tokenizer) or --tokenizer FILE")
    if not 0.0 < eval_fraction < 1.0:
        raise PrepareError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    tok_path = Path(tokenizer) if tokenizer is not None else None
    if tok_path is not None and not tok_path.is_file():
        raise PrepareError(f"tokenizer {tok_path} does not exist (expected a sentencepiece .model file)")
    try:
        files = corpus.list_input_files(inputs)
    except (FileNotFoundError, ValueError) as e:
        raise PrepareError(str(e)) from None
    fingerprint = _fingerprint(files, vocab_size, tok_path, eval_fraction, seed)
    if _check_output(output, fingerprint):
        return PrepareResult(output, True, TokenStore.open(output).manifest, time.perf_counter() - t0)

    try:
        texts = list(corpus.read_documents(files))
    except ValueError as e:
        raise PrepareError(str(e)) from None
    train, held = split_train_eval(texts, eval_fraction, seed)
    log(f"read {len(texts)} documents from {len(files)} file(s): {len(train)} train, {len(held)} eval")

    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.tok-") as tmpdir:
        model = Path(tmpdir) / "tokenizer.model"
        if tok_path is None:
            try:
                tok = Tokenizer.train(train, model, vocab_size)
            except ValueError as e:
                raise PrepareError(str(e)) from None
            log(f"trained tokenizer: vocab {tok.vocab_size} ({time.perf_counter() - t0:.1f}s)")
        else:
            try:
                tok = Tokenizer.load(tok_path)
            except (FileNotFoundError, ValueError) as e:
                raise PrepareError(str(e)) from None
            shutil.copyfile(tok_path, model)
        extra = {"prepare": {
            "fingerprint": fingerprint,
            "inputs": [str(f) for f in files],
            "vocab_size_requested": vocab_size,
            "tokenizer_source": str(tok_path) if tok_path else "trained",
            "eval_fraction": eval_fraction,
            "seed": seed,
        }}
        try:
            manifest = write_token_store(
                output,
                {"train": iter_encoded_documents(tok, train), "eval": iter_encoded_documents(tok, held)},
                tokenizer_path=model, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
                pad_id=tok.pad_id, extra_manifest=extra,
            )
        except FileExistsError as e:  # appeared while we worked
            raise PrepareError(str(e)) from None
    seconds = time.perf_counter() - t0
    s = manifest["splits"]
    log(f"wrote {output}: train {s['train']['num_docs']} docs / {s['train']['num_tokens']} tokens, "
        f"eval {s['eval']['num_docs']} docs / {s['eval']['num_tokens']} tokens in {seconds:.1f}s")
    return PrepareResult(output, False, manifest, seconds)
