"""A run's tokenizer as a Hugging Face tokenizer directory: `transformers.AutoTokenizer.from_pretrained(out)` gives
the run's own token ids, BOS included, as evaluation harnesses expect:

    encode(text)                            == [tok.bos_id] + tok.encode(text)
    encode(text, add_special_tokens=False)  == tok.encode(text)
    decode(ids, skip_special_tokens=True)   == tok.decode(ids)
    bos/eos/pad_token_id                    == tok.bos_id / eos_id / pad_id

A sentencepiece BPE model (jaxllm's, or Llama 2's with its dummy-prefix space) becomes a `tokenizer.json` whose
BPE model reproduces sentencepiece's merges: the vocabulary is the model's pieces, and every split (a, b) of a
piece p into two pieces is a merge ranked by p's score (sentencepiece merges the adjacent pair whose union
scores highest; the rank of a tokenizers merge plays that part). Spaces become U+2581 in the normaliser, characters
outside the vocabulary go to byte pieces, and a template prepends BOS. The `tokenizer.model` is kept beside it.
Other sentencepiece options (NFKC normalisation, unigram models, ...) are refused: their behaviour would only be
approximated. Not reproduced either, for ids that no encode gives but a model may generate: a run of byte pieces
that is not valid UTF-8 decodes to U+FFFD for each of its bytes (sentencepiece keeps the valid characters in it;
tokenizers' ByteFallback cannot), and with a dummy prefix an unknown piece first loses the space of its " ⁇ ".

A Hugging Face `tokenizer.json` is copied; its post-processor is rewritten in the copy when it does not already
prepend the run's BOS (a tokenizer without one, GPT-2/Qwen style, gets its EOS prepended, as jaxllm documents start).

Both get a `tokenizer_config.json` naming the special tokens with the generic `PreTrainedTokenizerFast` class,
so that transformers uses tokenizer.json as it is (a model-specific class may rebuild parts of it).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import tokenizers
from sentencepiece import sentencepiece_model_pb2 as model_pb2  # needs protobuf (grain and orbax require it)
from tokenizers import decoders, models, normalizers, processors

from jaxllm.data.hf_tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer
from jaxllm.data.tokenizer import (SENTENCEPIECE_FILE, AnyTokenizer, find_tokenizer_file, load_tokenizer,
                                   tokenizer_files)

SPACE = "\u2581"  # sentencepiece's whitespace marker
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # transformers' generic class: takes tokenizer.json as it is
_PIECE = model_pb2.ModelProto.SentencePiece
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}")
# Texts on which a tokenizer.json's own post-processor is tried (the empty one included: its BOS counts too).
_PROBES = ("", "a", "Hello, world!\n")
# Keys of an original tokenizer_config.json on which transformers would rebuild the copied post-processor, stop
# matching special tokens in text, or load a class of the model's own code; jaxllm's HFTokenizer reads none of
# them, so the copy must not have them.
_DROPPED_CONFIG_KEYS = ("add_bos_token", "add_eos_token", "split_special_tokens", "auto_map")


def save_tokenizer(tokenizer_file: str | os.PathLike, out_dir: str | os.PathLike) -> AnyTokenizer:
    """Write the tokenizer at `tokenizer_file` (a sentencepiece `.model`, a Hugging Face `tokenizer.json` with the
    files beside it, or a directory holding one) into `out_dir` so that
    `transformers.AutoTokenizer.from_pretrained(out_dir)` encodes every text to `[bos_id] + encode(text)` of the
    jaxllm tokenizer (see the module docstring). The source files are never changed. Returns the jaxllm tokenizer;
    raises ValueError naming the file when it cannot be exported exactly."""
    path, out = Path(tokenizer_file), Path(out_dir)
    path = (find_tokenizer_file(path) or path) if path.is_dir() else path  # load_tokenizer's own choice
    tok = load_tokenizer(path)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, HFTokenizer):
        _save_tokenizer_json(path, tok, out)
    else:
        fast = sentencepiece_to_tokenizers(tok.model_proto, str(path))
        fast.save(str(out / TOKENIZER_JSON))
        shutil.copyfile(path, out / SENTENCEPIECE_FILE)
        # sentencepiece reads "<s>" in a text as three characters: transformers must not match its special tokens.
        # No unk_token: transformers would make it special and drop it where sentencepiece decodes it as " ⁇ ".
        config = {"split_special_tokens": True}
        _write_config(out, fast, tok, config)
    return tok


# ------------------------------------------------------------------------------------------------ sentencepiece


def _parse(model_proto: bytes) -> model_pb2.ModelProto:
    proto = model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    return proto


def _check_exportable(proto: model_pb2.ModelProto, source: str) -> None:
    """A ValueError naming `source` unless its options are ones the tokenizer.json below reproduces exactly:
    BPE with byte fallback, identity normalisation, spaces escaped and kept as they are (a dummy prefix allowed)."""
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if trainer.model_type != model_pb2.TrainerSpec.BPE:
        problems.append(f"model_type {model_pb2.TrainerSpec.ModelType.Name(trainer.model_type)} (only BPE)")
    if not trainer.byte_fallback:
        problems.append("no byte_fallback")
    if norm.name != "identity" or norm.precompiled_charsmap or proto.denormalizer_spec.precompiled_charsmap:
        problems.append(f"normalization rule {norm.name!r} (only 'identity')")
    if norm.remove_extra_whitespaces or not norm.escape_whitespaces or trainer.treat_whitespace_as_suffix:
        problems.append("whitespace options (remove_extra_whitespaces, escape_whitespaces, "
                        "treat_whitespace_as_suffix) other than false, true, false")
    odd = {_PIECE.Type.Name(p.type) for p in proto.pieces if p.type in (_PIECE.USER_DEFINED, _PIECE.UNUSED)}
    if odd:
        problems.append(f"{' and '.join(sorted(odd))} pieces")
    if problems:
        raise ValueError(f"{source}: cannot export this sentencepiece model as a Hugging Face tokenizer.json: "
                         f"{'; '.join(problems)}")


def bpe_merges(proto: model_pb2.ModelProto) -> list[tuple[str, str]]:
    """The merges of a sentencepiece BPE model, first-applied first: every split (a, b) of a normal piece p into two
    normal pieces, ranked by p's score (highest first, then by id), a piece's splits by the length of a. Byte,
    control and unknown pieces never take part (sentencepiece merges only characters and the pieces made of them)."""
    ids = {p.piece: i for i, p in enumerate(proto.pieces) if p.type == _PIECE.NORMAL}
    ranked = []
    for piece, i in ids.items():
        score = proto.pieces[i].score
        ranked += [(-score, i, k, piece[:k], piece[k:]) for k in range(1, len(piece))
                   if piece[:k] in ids and piece[k:] in ids]
    return [(a, b) for *_, a, b in sorted(ranked)]


def sentencepiece_to_tokenizers(model_proto: bytes, source: str = SENTENCEPIECE_FILE) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` that encodes and decodes as the sentencepiece BPE model `model_proto` does (see the
    module docstring), BOS prepended by its post-processor. `source` names the model in errors."""
    proto = _parse(model_proto)
    _check_exportable(proto, source)
    bos_id = proto.trainer_spec.bos_id
    if bos_id < 0:
        raise ValueError(f"{source}: the sentencepiece model has no BOS token (bos_id {bos_id})")
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    unk = proto.pieces[proto.trainer_spec.unk_id].piece
    fast = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=bpe_merges(proto), unk_token=unk, byte_fallback=True,
                                           fuse_unk=True, dropout=None))
    # No pre-tokenizer: sentencepiece merges over the whole text, whose pieces decide where words end.
    dummy = proto.normalizer_spec.add_dummy_prefix
    fast.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE)] * dummy + [normalizers.Replace(" ", SPACE)])
    # The unknown piece is no special token (sentencepiece decodes it as its unk_surface, " ⁇ "); encode never gives
    # it (byte fallback), a model may. sentencepiece drops the dummy prefix's space again when decoding.
    fast.decoder = decoders.Sequence([decoders.Replace(_whole(unk), proto.trainer_spec.unk_surface),
                                      decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                      decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * dummy)
    special = [p.piece for p in proto.pieces if p.type == _PIECE.CONTROL]
    fast.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special])
    fast.post_processor = _bos_template(proto.pieces[bos_id].piece, bos_id)
    return fast


def _whole(token: str) -> tokenizers.Regex:
    """A pattern matching a decoder's token when it is `token` exactly (not a piece that merely contains it)."""
    return tokenizers.Regex("^" + "".join("\\" + c if c in _REGEX_SPECIAL else c for c in token) + "$")


# ------------------------------------------------------------------------------------------------ tokenizer.json


def _bos_template(bos: str, bos_id: int) -> processors.TemplateProcessing:
    """Prepend `bos` to every sequence (as Llama's template does, to both of a pair)."""
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def _prepends_bos(fast: tokenizers.Tokenizer, bos_id: int) -> bool:
    """Whether encoding with special tokens gives [bos_id] + the ids without, on every probe text."""
    return all(fast.encode(t).ids == [bos_id] + fast.encode(t, add_special_tokens=False).ids for t in _PROBES)


def _adds_nothing(fast: tokenizers.Tokenizer) -> bool:
    return all(fast.encode(t).ids == fast.encode(t, add_special_tokens=False).ids for t in _PROBES)


def _save_tokenizer_json(path: Path, tok: HFTokenizer, out: Path) -> None:
    """Copy the tokenizer.json and the files beside it; rewrite the copy's post-processor if it does not prepend
    the run's BOS."""
    files = tokenizer_files(path)
    for name, src in files.items():
        if name not in (TOKENIZER_JSON, TOKENIZER_CONFIG):
            shutil.copyfile(src, out / name)
    fast = tokenizers.Tokenizer.from_file(str(path))
    if _prepends_bos(fast, tok.bos_id):
        shutil.copyfile(path, out / TOKENIZER_JSON)
    else:
        template = _bos_template(fast.id_to_token(tok.bos_id), tok.bos_id)
        # A post-processor that adds no tokens (GPT-2's ByteLevel: offsets only) is kept, before the template.
        keep = fast.post_processor is not None and _adds_nothing(fast)
        fast.post_processor = processors.Sequence([fast.post_processor, template]) if keep else template
        fast.save(str(out / TOKENIZER_JSON))
    config = json.loads(files[TOKENIZER_CONFIG].read_text()) if TOKENIZER_CONFIG in files else {}
    for key in _DROPPED_CONFIG_KEYS:
        config.pop(key, None)
    _write_config(out, fast, tok, config)


def _write_config(out: Path, fast: tokenizers.Tokenizer, tok: AnyTokenizer, config: dict) -> None:
    """tokenizer_config.json: `config` with the run's bos/eos/pad tokens (null for a negative id: a sentencepiece
    model without that token, such as Llama 2's without a pad) and the generic class."""
    config = {**config, "tokenizer_class": TOKENIZER_CLASS, "clean_up_tokenization_spaces": False,
              **{f"{kind}_token": fast.id_to_token(i) if i >= 0 else None for kind, i in
                 (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id))}}
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

