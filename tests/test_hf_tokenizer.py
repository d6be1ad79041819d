"""Hugging Face tokenizer.json backend: parity with transformers' PreTrainedTokenizerFast (encode, decode, special
ids), special-id rules, load_tokenizer dispatch, pickling, chat templates, and a token store prepared with it."""
import gzip
import hashlib
import importlib.util
import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local files; never reach the Hub

import tokenizers  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from jaxllm.data.clean import normalize  # noqa: E402
from jaxllm.data.hf_tokenizer import HFTokenizer  # noqa: E402
from jaxllm.data.pipeline import make_eval_batches  # noqa: E402
from jaxllm.data.prepare import PrepareError, prepare  # noqa: E402
from jaxllm.data.token_store import TokenStore  # noqa: E402
from jaxllm.data.tokenizer import Tokenizer, find_tokenizer_file, load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "data" / "shakespeare.jsonl.gz"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONFIG = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
          "pad_token": "<pad>", "chat_template": TEMPLATE, "clean_up_tokenization_spaces": False}
TEXTS = [
    "", " ", "a", "Hello, world!", "  leading and trailing  ", "tabs\tand\n\nnewlines\n\n\n", "    indented code",
    "naïve café — “quoted” 日本語のテキスト 🙂🚀", "Ünïcödé ß ﬁ Ω ≈ ∑", "mixed\r\nline endings\r", "x" * 300,
    "spaces     in      runs", "literal specials </s> and <s> and <pad> inside text", "\u2581 sentencepiece marker",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
]


def _plays(n):
    with gzip.open(SHAKESPEARE, "rt") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def _train_bpe(path: Path, specials=("<pad>", "<s>", "</s>"), vocab_size=800, config=CONFIG, truncate=None):
    """A byte-level BPE tokenizer.json (and tokenizer_config.json when `config` is not None) in path's folder."""
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_plays(8) + TEXTS, trainer)
    if "<s>" in specials:  # like Llama 3's: a BOS that encode() must not add
        tk.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                          special_tokens=[("<s>", tk.token_to_id("<s>"))])
    if truncate:
        tk.enable_truncation(truncate)
    path.parent.mkdir(parents=True, exist_ok=True)
    tk.save(str(path))
    if config is not None:
        (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory):
    return _train_bpe(tmp_path_factory.mktemp("hf") / "tokenizer.json")


@pytest.fixture(scope="module")
def tok(hf_file):
    return load_tokenizer(hf_file)


def test_matches_transformers(hf_file, tok):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_file.parent))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (1, 2, 0)
    assert tok.vocab_size == len(ref) == 800
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        decoded = tok.decode(ids)
        assert decoded == ref.decode(ids, skip_special_tokens=True), text
        # Byte-level BPE is lossless, except that special tokens written in the text are tokens, so they drop out.
        assert decoded == text.replace("</s>", "").replace("<s>", "").replace("<pad>", ""), text
        with_specials = [tok.bos_id, *ids, tok.eos_id, tok.pad_id, tok.pad_id]
        assert tok.decode(with_specials) == ref.decode(with_specials, skip_special_tokens=True) == decoded
    assert tok.encode_batch(TEXTS) == tok.encode_batch(TEXTS, num_threads=1) == [tok.encode(t) for t in TEXTS]
    assert ref.encode("ab")[0] == tok.bos_id != tok.encode("ab")[0]  # the file's post-processor adds BOS, not encode
    assert tok.encode("a</s>b") == [tok.encode("a")[0], tok.eos_id, tok.encode("b")[0]]  # as transformers does


def test_load_tokenizer_picks_the_backend(hf_file, tmp_path):
    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    sp = Tokenizer.train(_plays(2), sp_dir / "tokenizer.model", vocab_size=400)
    assert isinstance(load_tokenizer(sp_dir), Tokenizer) and isinstance(load_tokenizer(sp_dir / "tokenizer.model"),
                                                                      Tokenizer)
    assert isinstance(load_tokenizer(hf_file), HFTokenizer) and isinstance(load_tokenizer(hf_file.parent), HFTokenizer)
    (sp_dir / "tokenizer.json").write_bytes(hf_file.read_bytes())  # both: tokenizer.json wins
    (sp_dir / "tokenizer_config.json").write_bytes((hf_file.parent / "tokenizer_config.json").read_bytes())
    assert find_tokenizer_file(sp_dir) == sp_dir / "tokenizer.json" and isinstance(load_tokenizer(sp_dir), HFTokenizer)
    assert Tokenizer.load(sp_dir / "tokenizer.model").model_proto == sp.model_proto  # the old entry point still works
    with pytest.raises(FileNotFoundError, match=r"nope\.json.*tokenizer\.json") as e:
        load_tokenizer(tmp_path / "nope.json")
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path / "empty")
    assert find_tokenizer_file(tmp_path / "empty") is None


def test_pickle_round_trip(hf_file, tok, tmp_path):
    d = tmp_path / "jinja"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(hf_file.read_bytes())
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    for t in (tok, load_tokenizer(d)):
        back = pickle.loads(pickle.dumps(t))
        assert [back.encode(x) for x in TEXTS] == [t.encode(x) for x in TEXTS]
        assert (back.vocab_size, back.bos_id, back.eos_id, back.pad_id, back.chat_template, back.model_proto) == (
            t.vocab_size, t.bos_id, t.eos_id, t.pad_id, t.chat_template, t.model_proto)
    assert back.chat_template == "{{ messages[0]['content'] }}"


def test_chat_template(hf_file, tok, tmp_path):
    pytest.importorskip("transformers")
    assert tok.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    hf = tok.as_transformers()
    assert hf.apply_chat_template(messages, tokenize=False) == "<s><|user|>Hi there</s><|assistant|>Hello!</s>"
    assert hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == (
        "<s><|user|>Hi there</s><|assistant|>")
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert hf.encode(TEXTS[7], add_special_tokens=False) == tok.encode(TEXTS[7])
    # A list of named templates: the "default" one. A template in chat_template.jinja beside the file.
    d = tmp_path / "named"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(hf_file.read_bytes())
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ eos_token }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps({**CONFIG, "chat_template": named}))
    t = load_tokenizer(d)
    assert t.chat_template == "{{ eos_token }}"
    assert t.as_transformers().apply_chat_template(messages, tokenize=False) == "</s>"
    (d / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "chat_template"}))
    assert load_tokenizer(d).chat_template is None
    (d / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]")
    t = load_tokenizer(d)
    assert t.chat_template == "[{{ messages[0]['content'] }}]"
    assert t.as_transformers().apply_chat_template(messages, tokenize=False) == "[Hi there]"


def test_as_transformers_needs_transformers(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ImportError, match="pip install transformers") as e:
        tok.as_transformers()
    assert "\n" not in str(e.value)


def test_special_id_rules(hf_file, tmp_path):
    def write(name, config, **kw):
        return load_tokenizer(_train_bpe(tmp_path / name / "tokenizer.json", config=config, **kw))

    # No config: the well-known added tokens.
    t = write("plain", None)
    assert (t.pad_id, t.bos_id, t.eos_id) == (0, 1, 2)
    # null means none: no BOS -> bos = eos (GPT-2 convention), no pad -> pad = eos.
    t = write("nulls", {"bos_token": None, "eos_token": "</s>", "pad_token": None})
    assert t.bos_id == t.eos_id == 2 and t.pad_id == 2
    assert t.decode([2, *t.encode("ab"), 2]) == "ab"
    # No bos_token in the config and no well-known BOS in the vocabulary: bos = eos.
    t = write("gpt2", {"eos_token": "<|endoftext|>"}, specials=("<|endoftext|>",))
    assert t.bos_id == t.eos_id == t.pad_id == 0
    # A config token that is an ordinary vocabulary entry becomes special (as in transformers).
    t = write("word", {"eos_token": "the"})
    the = t._tk.token_to_id("the")
    assert t.eos_id == the and t.decode([the]) == ""
    # Errors, one line each, naming the file.
    with pytest.raises(ValueError, match=r"noeos.tokenizer\.json: no EOS token") as e:
        write("noeos", None, specials=("<pad>",))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<\|eot\|>' is not in the vocabulary"):
        write("missing", {"eos_token": "<|eot|>"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: bos_token must be"):
        write("badtype", {"bos_token": 3, "eos_token": "</s>"})


def test_corrupt_files(hf_file, tmp_path):
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    for load in (load_tokenizer, HFTokenizer.load):
        with pytest.raises(ValueError, match=r"bad.tokenizer\.json is not a valid Hugging Face tokenizer\.json") as e:
            load(bad)
        assert "\n" not in str(e.value)
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not a valid Hugging Face tokenizer.json"):
        load_tokenizer(bad.parent)
    bad.write_bytes(hf_file.read_bytes())
    (bad.parent / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"bad.tokenizer_config\.json is not valid JSON") as e:
        load_tokenizer(bad)
    assert "\n" not in str(e.value)


def test_truncation_in_the_file_is_ignored(tmp_path):
    t = load_tokenizer(_train_bpe(tmp_path / "tokenizer.json", truncate=4))
    text = "To be, or not to be, that is the question"
    assert len(t.encode(text)) > 4 and t.decode(t.encode(text)) == text
    assert [len(x) for x in t.encode_batch([text, text])] == [len(t.encode(text))] * 2


def _prepare_data_main():
    spec = importlib.util.spec_from_file_location("prepare_data_script", ROOT / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_prepare_with_tokenizer_json(hf_file, tok, tmp_path, capsys):
    texts = [normalize(t) for t in _plays(12)]
    assert [normalize(t) for t in texts] == texts  # cleaning leaves them as they are: documents are predictable
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "ds"
    assert _prepare_data_main()(["--input", str(src), "--output", str(out), "--tokenizer", str(hf_file),
                                 "--eval_fraction", "0.2", "--dedup.near=false"]) == 0
    store = TokenStore.open(out)
    m = store.manifest
    assert m["tokenizer"] == "tokenizer.json" and store.tokenizer_path == out / "tokenizer.json"
    assert (out / "tokenizer_config.json").read_bytes() == (hf_file.parent / "tokenizer_config.json").read_bytes()
    assert not (out / "tokenizer.model").exists()
    assert (m["vocab_size"], m["bos_id"], m["eos_id"], m["pad_id"]) == (tok.vocab_size, tok.bos_id, tok.eos_id,
                                                                       tok.pad_id)
    assert m["tokenizer_sha256"] == hashlib.sha256(tok.model_proto).hexdigest()
    docs = [tuple(store.split(s).doc(i).tolist()) for s in ("train", "eval") for i in range(store.split(s).num_docs)]
    assert sorted(docs) == sorted(tuple([tok.bos_id, *tok.encode(t), tok.eos_id]) for t in texts)
    stored = load_tokenizer(store.tokenizer_path)
    assert isinstance(stored, HFTokenizer) and stored.model_proto == tok.model_proto
    batches = make_eval_batches(out, split="eval", batch_size=2, seq_len=64, max_batches=2)
    batch = next(iter(batches))
    assert batch["tokens"].shape == (2, 64) and int(np.max(batch["tokens"])) < tok.vocab_size
    assert tok.bos_id in batch["tokens"][0]
    # Re-running is up to date; a corrupt tokenizer is one `error:` line naming the file.
    capsys.readouterr()
    assert _prepare_data_main()(["--input", str(src), "--output", str(out), "--tokenizer", str(hf_file),
                                 "--eval_fraction", "0.2", "--dedup.near=false"]) == 0
    assert "up to date" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert _prepare_data_main()(["--input", str(src), "--output", str(tmp_path / "ds2"), "--tokenizer", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "bad.json is not a valid" in err
    with pytest.raises(PrepareError, match="tokenizer not found"):
        prepare([src], tmp_path / "ds3", tokenizer=tmp_path / "missing.json", log=lambda *a: None)
