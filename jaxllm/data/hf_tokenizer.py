"""Hugging Face `tokenizer.json` tokenizers (Llama 3, Qwen, Mistral, GPT-2...) behind jaxllm's tokenizer interface.

`HFTokenizer` has the interface of the sentencepiece `Tokenizer` (jaxllm/data/tokenizer.py): `encode` adds no
special tokens, `decode` drops them, and the pad/bos/eos ids are fixed when the file is loaded.

Special tokens. `tokenizer_config.json` beside the file decides where it names one (`bos_token`, `eos_token`,
`pad_token`: a string, a dict with "content", or null for none). A token it does not mention is looked for
among the vocabulary's added tokens under its well-known names (`<|begin_of_text|>`, `<s>`, ... for BOS;
`<|end_of_text|>`, `</s>`, `<|endoftext|>`, ... for EOS; `<pad>`, ... for pad). Then:

- no EOS token is an error (documents end with EOS);
- no BOS token: bos_id = eos_id (the GPT-2 convention: one token separates documents);
- no pad token: pad_id = eos_id (padding is masked out of the loss, so any id will do).

As in transformers, the named special tokens that tokenizer.json does not already list as added tokens are
registered as special, so `decode` drops them exactly as `PreTrainedTokenizerFast.decode(...,
skip_special_tokens=True)` does.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import tokenizers

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.47 saves a chat template

# Well-known spellings, most specific first; matched only against added tokens (a plain BPE piece "<s>" is
# HTML's strikethrough, not a BOS).
_WELL_KNOWN = {
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"),
    "eos": ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|padding|>"),
}


def companion_files(path: str | os.PathLike) -> dict[str, Path]:
    """The files that make up the tokenizer.json at `path`, keyed by the name a copy of each should have.

    `tokenizer.json` itself first, then `tokenizer_config.json` and `chat_template.jinja` when they are beside it.
    """
    path = Path(path)
    files = {TOKENIZER_JSON: path}
    for name in (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE):
        if (path.parent / name).is_file():
            files[name] = path.parent / name
    return files


def _token_content(value, key: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: {key} must be a string, a dict with \"content\" or null, got {value!r}")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer with jaxllm's interface (special ids: see the module docstring)."""

    def __init__(self, tokenizer_json: bytes, config_json: bytes | None = None,
                 chat_template_jinja: bytes | None = None, *, source: str = TOKENIZER_JSON):
        """From the bytes of tokenizer.json, tokenizer_config.json and chat_template.jinja (None: absent); `source`
        names the file in error messages. Raises ValueError naming the file if one is invalid."""
        self._json, self._config_bytes, self._jinja = tokenizer_json, config_json, chat_template_jinja
        self._source = source
        try:
            self._tk = tokenizers.Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as e:  # the Rust side raises a plain Exception for any parse error
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{source} is not a valid Hugging Face tokenizer.json: {reason}") from None
        # A tokenizer.json may carry truncation/padding settings (for classifiers): documents must come out whole.
        self._tk.no_truncation()
        self._tk.no_padding()
        config_name = str(Path(source).with_name(TOKENIZER_CONFIG))
        try:
            self._config = json.loads(config_json) if config_json is not None else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{config_name} is not valid JSON: {e}") from None
        if not isinstance(self._config, dict):
            raise ValueError(f"{config_name}: expected a JSON object")
        try:
            self._template_file = chat_template_jinja.decode("utf-8") if chat_template_jinja is not None else None
        except UnicodeDecodeError as e:
            raise ValueError(f"{Path(source).with_name(CHAT_TEMPLATE_FILE)} is not UTF-8 text: {e}") from None
        added = {t.content for t in self._tk.get_added_tokens_decoder().values()}
        self._tokens = {kind: self._special_token(kind, added, config_name) for kind in ("bos", "eos", "pad")}
        if self._tokens["eos"] is None:
            raise ValueError(
                f"{source}: no EOS token (tokenizer_config.json names none and none of "
                f"{', '.join(_WELL_KNOWN['eos'])} is an added token); documents need one to end with")
        new = [t for t in dict.fromkeys(self._tokens.values()) if t is not None and t not in added]
        if new:  # what transformers does with named special tokens (see the module docstring)
            self._tk.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in new])
        ids = {kind: (None if t is None else self._tk.token_to_id(t)) for kind, t in self._tokens.items()}
        self._eos_id = ids["eos"]
        self._bos_id = ids["bos"] if ids["bos"] is not None else self._eos_id
        self._pad_id = ids["pad"] if ids["pad"] is not None else self._eos_id
        # Ids need not be contiguous (added tokens can sit anywhere): the size is the largest id + 1.
        self._vocab_size = max(self._tk.get_vocab(with_added_tokens=True).values()) + 1

    def _special_token(self, kind: str, added: set[str], config_name: str) -> str | None:
        key = f"{kind}_token"
        if key in self._config:
            token = _token_content(self._config[key], key, config_name)
            if token is not None and self._tk.token_to_id(token) is None:
                raise ValueError(f"{config_name}: {key} {token!r} is not in the vocabulary of {self._source}")
            return token
        return next((t for t in _WELL_KNOWN[kind] if t in added), None)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HFTokenizer":
        """Load a tokenizer.json, with the tokenizer_config.json (and chat_template.jinja) beside it if any."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer not found: {path} (expected a Hugging Face tokenizer.json)")
        files = companion_files(path)
        config = files[TOKENIZER_CONFIG].read_bytes() if TOKENIZER_CONFIG in files else None
        template = files[CHAT_TEMPLATE_FILE].read_bytes() if CHAT_TEMPLATE_FILE in files else None
        return cls(path.read_bytes(), config, template, source=str(path))

    def encode(self, text: str) -> list[int]:
        """Token ids of text, no special tokens added (the post-processor's BOS is not applied)."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 2) -> list[list[int]]:
        """encode() of many texts. With num_threads > 1 this uses the `tokenizers` thread pool, whose size is
        set process-wide (RAYON_NUM_THREADS, TOKENIZERS_PARALLELISM), not per call; 1 encodes in this thread."""
        if num_threads <= 1:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids, special tokens (pad/bos/eos and the file's other special tokens) dropped."""
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1, added tokens included."""
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def model_proto(self) -> bytes:
        """The tokenizer's files joined by NUL bytes (tokenizer.json, then tokenizer_config.json and
        chat_template.jinja when present): equal bytes mean the same tokenizer. A token store's
        `tokenizer_sha256` is the sha256 of these bytes."""
        parts = [self._json]
        if self._config_bytes is not None:
            parts.append(self._config_bytes)
        if self._jinja is not None:
            parts.append(self._jinja)
        return b"\0".join(parts)

    @property
    def chat_template(self) -> str | None:
        """The chat template (Jinja): tokenizer_config.json's `chat_template` (of a list of {name, template},
        the one named "default"), else chat_template.jinja beside the file, else None."""
        template = self._config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        return template if isinstance(template, str) else self._template_file

    def as_transformers(self):
        """This tokenizer as a `transformers.PreTrainedTokenizerFast` (same files, special tokens and chat
        template), e.g. for `.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`.

        Its bos/pad tokens are the file's own (None where there is none), not jaxllm's EOS stand-ins.
        """
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise ImportError("HFTokenizer.as_transformers needs transformers for model chat templates: "
                              "pip install transformers") from None
        template = self._config.get("chat_template")
        if not isinstance(template, (str, list)):
            template = self._template_file
        unk = self._config.get("unk_token")
        kwargs = {f"{kind}_token": token for kind, token in self._tokens.items()}
        kwargs["unk_token"] = _token_content(unk, "unk_token", TOKENIZER_CONFIG) if unk is not None else None
        if isinstance(self._config.get("model_max_length"), int):
            kwargs["model_max_length"] = self._config["model_max_length"]
        # From the original bytes, not self._tk: transformers registers the special tokens itself.
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / TOKENIZER_JSON
            file.write_bytes(self._json)
            return PreTrainedTokenizerFast(tokenizer_file=str(file), chat_template=template,
                                           clean_up_tokenization_spaces=False, **kwargs)

    def __getstate__(self):  # the Rust tokenizer is rebuilt from the bytes (grain workers pickle tokenizers)
        return {"json": self._json, "config": self._config_bytes, "template": self._jinja,
                "source": self._source}

    def __setstate__(self, state):
        self.__init__(state["json"], state["config"], state["template"], source=state["source"])
