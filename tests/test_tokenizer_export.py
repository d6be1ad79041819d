"""Tokenizer export (jaxllm/interop/tokenizer_export.py): `transformers.AutoTokenizer` on the exported directory gives
the run's own ids, BOS included (what lm-evaluation-harness's `hf` backend compares against ours), for
sentencepiece models (jaxllm's, and a Llama 2 style one with a dummy prefix) and for tokenizer.json files with and
without a BOS token."""
import gzip
import io
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local files; never reach the Hub

import sentencepiece as spm  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from jaxllm.data.tokenizer import Tokenizer  # noqa: E402
from jaxllm.interop.tokenizer_export import save_tokenizer  # noqa: E402

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "data" / "shakespeare.jsonl.gz"
EDGE = [
    "", " ", "  ", "   x", "x   ", "  two  leading and trailing  ", "a  b   c    d", "\n", "\n\nx\n\n", "line\n",
    "\ttab\t\tx\t", "a\r\nb\rc", "x  \n  y", "12345 007 3.14159", "é", "naïve café", "—", "— dash —", "🙂", "🙂🚀 ok",
    "日本語のテキスト", "\u00a0nbsp", "ﬁ Ａ", "\x00\x01\x7f", "<s> </s> <pad> <unk>", "<|endoftext|> literal",
    "aaaa aaaaa    bbbb", "\u2581 marker", "To be, or not to be, that is the question:",
]


@pytest.fixture(scope="module")
def docs():
    with gzip.open(SHAKESPEARE, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def texts(docs):
    """A few hundred corpus lines (from documents the tokenizers were not trained on), two whole documents and
    the edge strings."""
    lines = [line for doc in docs[100:] for line in doc.split("\n") if line]
    return lines[::len(lines) // 400][:400] + docs[-2:] + EDGE


def _sentencepiece(path: Path, docs, llama_style: bool) -> Path:
    if not llama_style:  # jaxllm's own trainer options
        Tokenizer.train(docs, path, vocab_size=512)
        return path
    buf = io.BytesIO()  # Llama 2's options: a dummy-prefix space, no whitespace-only pieces (and ids of its own)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_writer=buf, vocab_size=512, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, max_sentence_length=1 << 20, num_threads=2, minloglevel=2)
    path.write_bytes(buf.getvalue())
    return path


def _tokenizer_json(path: Path, docs, bos: bool) -> Path:
    """A byte-level BPE tokenizer.json: Llama 3 style with a BOS its post-processor adds (and a tokenizer_config.json
    whose model-specific class would rebuild it), or GPT-2 style with one <|endoftext|> token and no config."""
    specials = ["<pad>", "<s>", "</s>"] if bos else ["<|endoftext|>"]
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
                  "tokenizer_class": "LlamaTokenizer", "chat_template": "{{ messages }}"}
        (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)  # adds no tokens: kept before the BOS template
    tk.save(str(path))
    return path


CASES = ("sentencepiece", "sentencepiece-dummy-prefix", "tokenizer.json-bos", "tokenizer.json-no-bos")


@pytest.fixture(scope="module", params=CASES)
def exported(request, docs, tmp_path_factory):
    """(the case, the jaxllm tokenizer, its source directory's files and bytes before the export, the export)."""
    src = tmp_path_factory.mktemp("src")
    train_docs = docs[:40]
    if request.param.startswith("sentencepiece"):
        file = _sentencepiece(src / "tokenizer.model", train_docs, request.param.endswith("prefix"))
    else:
        file = _tokenizer_json(src / "tokenizer.json", train_docs, request.param == "tokenizer.json-bos")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = tmp_path_factory.mktemp("out")
    tok = save_tokenizer(file, out)
    return request.param, tok, src, before, out


def test_auto_tokenizer_gives_the_run_ids(exported, texts):
    case, tok, _, _, out = exported
    ref = transformers.AutoTokenizer.from_pretrained(out)
    assert (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    if case.endswith("no-bos"):
        assert tok.bos_id == tok.eos_id  # jaxllm's documents then start with EOS, and so do the reference's
    bad = []
    for text in texts:
        ids = tok.encode(text)
        document = [tok.bos_id] + ids + [tok.eos_id]
        if (ref.encode(text) != [tok.bos_id] + ids or ref.encode(text, add_special_tokens=False) != ids
                or ref.decode(document, skip_special_tokens=True) != tok.decode(document)):
            bad.append(text)
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first {bad[:3]!r}"
    if case.startswith("sentencepiece"):
        assert tok.encode("🙂")[-4:] == [4 + b for b in "🙂".encode()]  # the edge strings do reach byte fallback
        # Ids a model may generate though encode never gives them: the unknown piece decodes as sentencepiece's " ⁇ ".
        generated = [*tok.encode("What say you?"), ref.convert_tokens_to_ids("<unk>"), *tok.encode(" é 🙂")]
        assert ref.decode(generated, skip_special_tokens=True) == tok.decode(generated)


def test_export_keeps_the_sources(exported):
    case, _, src, before, out = exported
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    names = {p.name for p in out.iterdir()}
    if case.startswith("sentencepiece"):  # the model itself stays beside the tokenizer.json, for sentencepiece users
        assert names == {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"}
        assert (out / "tokenizer.model").read_bytes() == before["tokenizer.model"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["clean_up_tokenization_spaces"] is False
    if case == "tokenizer.json-bos":  # merged with the original config; its BOS post-processor was already right
        assert config["chat_template"] == "{{ messages }}" and "add_bos_token" not in config
        assert (out / "tokenizer.json").read_bytes() == before["tokenizer.json"]
    if case == "tokenizer.json-no-bos":  # GPT-2's offsets-only ByteLevel processor kept, the BOS template after it
        processor = json.loads((out / "tokenizer.json").read_text())["post_processor"]
        assert [p["type"] for p in processor["processors"]] == ["ByteLevel", "TemplateProcessing"]


def test_refuses_other_normalisers(docs, tmp_path):
    model = tmp_path / "nfkc.model"
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs[:5]), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="nmt_nfkc",
                                   minloglevel=2)
    model.write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match=r"nfkc\.model: cannot export .*'nmt_nfkc'") as exc:
        save_tokenizer(model, tmp_path / "out")
    assert "\n" not in str(exc.value)
