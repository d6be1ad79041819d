"""Byte-exact sentencepiece BPE tokenizer: decode(encode(text)) == text for any text without U+2581.

The trainer options are chosen for exact round trips rather than sentencepiece's defaults:
identity normalisation (no NFKC), no whitespace collapsing, no dummy-prefix space, byte fallback for any
character outside the vocabulary, and whitespace-only pieces so runs of spaces and newlines get tokens of
their own ('\n' is then an ordinary learned piece). The one input that cannot round-trip is U+2581 '▁'
itself, which sentencepiece uses as its internal space marker (decoded as ' ').

`load_tokenizer` is the one way to open an existing tokenizer: a sentencepiece `.model` file gives a
`Tokenizer`, a Hugging Face `tokenizer.json` an `HFTokenizer` (jaxllm/data/hf_tokenizer.py) with the same
interface.
"""
from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from jaxllm.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer, companion_files

SENTENCEPIECE_FILE = "tokenizer.model"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Trainer settings shared by every tokenizer jaxllm builds (see the module docstring for why).
_TRAINER_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    add_dummy_prefix=False,
    split_digits=True,
    pad_id=PAD_ID,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    hard_vocab_limit=False,
    character_coverage=0.9995,  # the rarest characters go to byte fallback instead of using up the vocab
    num_threads=2,
    minloglevel=2,
)
# Documents longer than this are cut (for training only) so sentencepiece does not silently skip them.
_MAX_TRAIN_DOC_CHARS = 1 << 16


def _sample_texts(texts: Iterable[str], max_chars: int) -> list[str]:
    """Deterministic, order-independent sample of at most ~max_chars of text, streaming in bounded memory.

    A document is kept when a hash of its text falls under a threshold; the threshold halves (dropping the
    kept documents above it) whenever the kept text exceeds the budget, so the result depends only on the
    set of documents, not on their order or on any RNG state.
    """
    threshold = 1 << 64
    kept: list[tuple[int, str]] = []
    total = 0
    for text in texts:
        text = text[:_MAX_TRAIN_DOC_CHARS]
        h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        if h >= threshold or not text:
            continue
        kept.append((h, text))
        total += len(text)
        while total > max_chars and len(kept) > 1:
            threshold //= 2
            kept = [(k, t) for k, t in kept if k < threshold]
            total = sum(len(t) for _, t in kept)
    kept.sort()  # canonical order: sentencepiece's result must not depend on input order
    return [t for _, t in kept]


class Tokenizer:
    """A sentencepiece model with jaxllm's fixed special ids: pad 0, unk 1, bos 2, eos 3."""

    def __init__(self, processor: spm.SentencePieceProcessor, model_proto: bytes):
        self._sp = processor
        self._proto = model_proto

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        model_path: str | os.PathLike,
        vocab_size: int,
        *,
        max_train_chars: int = 8_000_000,
    ) -> "Tokenizer":
        """Train a byte-fallback BPE tokenizer on (a deterministic sample of at most max_train_chars of) texts.

        Writes the model to model_path (atomically) and returns the loaded Tokenizer.
        """
        sample = _sample_texts(texts, max_train_chars)
        if not sample:
            raise ValueError("cannot train a tokenizer on an empty corpus (no non-empty texts)")
        buf = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample),
                model_writer=buf,
                vocab_size=vocab_size,
                max_sentence_length=4 * _MAX_TRAIN_DOC_CHARS + 16,  # in bytes
                input_sentence_size=0,  # use every sampled document (sampling is done above, deterministically)
                **_TRAINER_OPTIONS,
            )
        except RuntimeError as e:  # e.g. vocab smaller than 256 bytes + specials + required characters
            msg = str(e).splitlines()[0].split("] ")[-1]
            raise ValueError(f"sentencepiece training failed for vocab_size {vocab_size}: {msg}") from None
        proto = buf.getvalue()
        model_path = Path(model_path)
        tmp = model_path.with_name(f"{model_path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(proto)
        os.replace(tmp, model_path)
        return cls.from_bytes(proto)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a sentencepiece model file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {path} (expected a sentencepiece .model file)")
        try:
            return cls.from_bytes(path.read_bytes())
        except RuntimeError as e:
            raise ValueError(f"{path} is not a valid sentencepiece model: {e}") from None

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> "Tokenizer":
        """Build from the serialized model (what `.model` files hold)."""
        return cls(spm.SentencePieceProcessor(model_proto=model_proto), model_proto)

    def encode(self, text: str) -> list[int]:
        """Token ids of text, no BOS/EOS added."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 2) -> list[list[int]]:
        """encode() of many texts, using sentencepiece's thread pool."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; special ids (pad/bos/eos) decode to ''."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def model_proto(self) -> bytes:
        """The serialized model: equal bytes mean the same tokenizer."""
        return self._proto

    def __getstate__(self):  # the SWIG processor is not picklable; the proto is all we need
        return {"proto": self._proto}

    def __setstate__(self, state):
        self.__init__(spm.SentencePieceProcessor(model_proto=state["proto"]), state["proto"])


AnyTokenizer = Tokenizer | HFTokenizer


def find_tokenizer_file(directory: str | os.PathLike) -> Path | None:
    """`directory`'s tokenizer.json if it has one, else its tokenizer.model, else None."""
    directory = Path(directory)
    return next((directory / n for n in (TOKENIZER_JSON, SENTENCEPIECE_FILE) if (directory / n).is_file()), None)


def tokenizer_files(path: str | os.PathLike) -> dict[str, Path]:
    """The files a copy of the tokenizer at `path` needs, keyed by the name each copy should have: a `.json`
    file is a Hugging Face tokenizer.json (plus the tokenizer_config.json / chat_template.jinja beside it),
    any other file a sentencepiece model (copied as tokenizer.model)."""
    path = Path(path)
    return companion_files(path) if path.suffix == ".json" else {SENTENCEPIECE_FILE: path}


def load_tokenizer(path: str | os.PathLike) -> AnyTokenizer:
    """The tokenizer at `path`: a `.json` file -> HFTokenizer, any other file -> sentencepiece Tokenizer, a
    directory -> its tokenizer.json, else its tokenizer.model.

    Raises FileNotFoundError when there is none there, ValueError when the file is not a valid tokenizer.
    """
    path = Path(path)
    if path.is_dir():
        found = find_tokenizer_file(path)
        if found is None:
            raise FileNotFoundError(f"no tokenizer in directory {path} (expected {TOKENIZER_JSON} or "
                                    f"{SENTENCEPIECE_FILE} in it)")
        path = found
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {path} (expected a sentencepiece .model file, a Hugging "
                                f"Face tokenizer.json, or a directory holding one)")
    return HFTokenizer.load(path) if path.suffix == ".json" else Tokenizer.load(path)


def iter_encoded_documents(tok: AnyTokenizer, texts: Iterable[str], batch_docs: int = 256) -> Iterator[list[int]]:
    """Yield [bos] + encode(text) + [eos] for each text, encoding in batches for throughput."""
    batch: list[str] = []

    def flush():
        for ids in tok.encode_batch(batch):
            yield [tok.bos_id, *ids, tok.eos_id]

    for text in texts:
        batch.append(text)
        if len(batch) >= batch_docs:
            yield from flush()
            batch = []
    if batch:
        yield from flush()
