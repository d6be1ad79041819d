"""SFT data and loss: templates and response masks, the loss mask, packed-example isolation, preparation's counting
of bad lines and over-long examples, re-runs, and the base-model fingerprint."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.families import FAMILIES
from jaxllm.config.schema import MeshConfig, ModelConfig, PrecisionConfig
from jaxllm.data.row_prep import PreparedDataError, PreparedRows
from jaxllm.data.sft import encode_examples, pack, prepare_sft
from jaxllm.data.sft_template import TemplateError, encode, prompt_pieces, render, stop_ids
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.runs.base_model import fingerprint
from jaxllm.model.head import next_token_loss
from jaxllm.model.build import build_model

MODEL = ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Romeo?"},
        {"role": "assistant", "content": "A Montague."}, {"role": "user", "content": "And Juliet?"},
        {"role": "assistant", "content": "A Capulet."}]


@pytest.fixture(scope="module")
def tokenizer(shakespeare_store):
    return load_tokenizer(shakespeare_store / "tokenizer.model")


@pytest.fixture(scope="module")
def model():
    return build_model(MODEL, F32, jax.random.key(0))


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("template", ["alpaca", "chatml"])
def test_template_masks_only_responses(tokenizer, template):
    pieces = render(template, CHAT, tokenizer)
    ids, mask = encode(pieces, tokenizer)
    assert ids[0] == tokenizer.bos_id and len(ids) == len(mask)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "A Montague.A Capulet."  # both assistant turns (and their EOS, which decodes to '')
    assert sum(i == tokenizer.eos_id for i, m in zip(ids, mask) if m) == 2
    untrained = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "Who is Romeo?" in untrained and "And Juliet?" in untrained and "Montague" not in untrained
    prompt = encode(prompt_pieces(pieces), tokenizer)[0]
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1 and not mask[len(prompt) - 1]


def test_model_template_needs_a_chat_template(tokenizer):
    with pytest.raises(TemplateError, match="chat_template"):
        render("model", CHAT, tokenizer)


def _rows(tokenizer, seq_len=128):
    examples = [[{"role": "user", "content": f"Line {i} of the play?"},
                 {"role": "assistant", "content": "Enter ROMEO." * (1 + i % 3)}] for i in range(12)]
    encoded = encode_examples([(m, "t") for m in examples], tokenizer, "alpaca", seq_len, "truncate")
    return encoded, pack(encoded.examples, seq_len, seed=0)


def test_packing_is_exact(tokenizer):
    encoded, rows = _rows(tokenizer)
    assert rows["tokens"].shape[0] < len(encoded.examples)  # several examples share rows
    seen = []
    for r in range(rows["tokens"].shape[0]):
        seg = rows["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            assert np.array_equal(at, np.arange(at[0], at[-1] + 1))  # contiguous
            assert np.array_equal(rows["positions"][r, at], np.arange(len(at)))  # positions restart
            seen.append((list(rows["tokens"][r, at]) + [int(rows["targets"][r, at[-1]])],
                         list(rows["loss_mask"][r, at])))
        assert not rows["loss_mask"][r][seg == 0].any()
    expected = sorted((ids, mask[1:]) for ids, mask in encoded.examples)
    assert sorted(seen) == expected


def test_loss_counts_response_tokens_only(tokenizer, model):
    _, rows = _rows(tokenizer)
    batch = {k: jnp.asarray(v[:4]) for k, v in rows.items()}
    loss, count, _ = next_token_loss(model, batch)
    assert count == batch["loss_mask"].sum()
    assert ((batch["loss_mask"] == 0) & (batch["segment_ids"] > 0)).sum() > count  # prompts outweigh responses
    prompt_targets = np.asarray(batch["targets"]).copy()
    prompt_targets[np.asarray(batch["loss_mask"]) == 0] = 7  # any other token where the mask is 0
    changed, _, _ = next_token_loss(model, dict(batch, targets=jnp.asarray(prompt_targets)))
    assert changed == loss  # bitwise: prompt-token targets do not enter the loss
    response_target = np.asarray(batch["targets"]).copy()
    r, t = np.argwhere(np.asarray(batch["loss_mask"]) == 1)[0]
    response_target[r, t] = (response_target[r, t] + 1) % MODEL.vocab_size
    moved, _, _ = next_token_loss(model, dict(batch, targets=jnp.asarray(response_target)))
    assert moved != loss


def test_packed_examples_do_not_see_each_other(tokenizer, model):
    _, rows = _rows(tokenizer)
    r = int(np.argmax(rows["segment_ids"].max(axis=1)))  # a row holding several examples
    seg = rows["segment_ids"][r]
    packed = model(jnp.asarray(rows["tokens"][r:r + 1]), jnp.asarray(seg[None]), jnp.asarray(rows["positions"][r:r + 1]))
    for s in range(1, seg.max() + 1):
        at = np.flatnonzero(seg == s)
        alone = model(jnp.asarray(rows["tokens"][r:r + 1, at]), jnp.ones((1, len(at)), jnp.int32),
                      jnp.asarray(rows["positions"][r:r + 1, at]))
        np.testing.assert_allclose(np.asarray(packed[0, at]), np.asarray(alone[0]), atol=1e-5)


def _prepare(tmp_path, train, tokenizer_path, log=None, **kw):
    settings = dict(eval_file="", template="alpaca", seq_len=64, overlong="truncate", eval_fraction=0.2, seed=0)
    settings.update(kw)
    return prepare_sft(tmp_path / "prepared", train_file=train, tokenizer_path=tokenizer_path,
                       log=log or (lambda *_: None), **settings)


def test_bad_lines_are_counted_with_line_numbers(tmp_path, shakespeare_store):
    good = [{"prompt": f"Who speaks line {i}?", "response": "ROMEO."} for i in range(10)]
    train = _write(tmp_path / "train.jsonl", good[:4] + [
        "{not json", {"prompt": "no response"}, {"prompt": "x", "response": 3},
        {"messages": [{"role": "user", "content": "last turn is not the assistant's"}]},
        {"messages": [{"role": "narrator", "content": "?"}, {"role": "assistant", "content": "!"}]},
        "", "[1, 2]"] + good[4:] + [{"prompt": "Speak! " * 40, "response": "Anon."}])
    logged = []
    manifest = _prepare(tmp_path, train, shakespeare_store / "tokenizer.model", log=logged.append)
    assert manifest["skipped_lines"] == 6
    reasons = {s["line"]: s["reason"] for s in manifest["skipped"]}
    assert reasons == {5: "not valid JSON", 6: "missing field 'response'", 7: "field 'response' must be a string",
                       8: "the last message must be the assistant's",
                       9: "each message needs a role in ['system', 'user', 'assistant'] and a string content",
                       11: "expected a JSON object"}
    assert any("line 5: not valid JSON" in line for line in logged)
    splits = manifest["splits"]
    assert splits["train"]["examples"] + splits["eval"]["examples"] + sum(
        sum(s["dropped"].values()) for s in splits.values()) == 11
    assert sum(s["dropped"].get("prompt_too_long", 0) for s in splits.values()) == 1  # no response left after the cut
    dropped = _prepare(tmp_path / "drop", train, shakespeare_store / "tokenizer.model", overlong="drop")
    assert sum(s["dropped"].get("too_long", 0) for s in dropped["splits"].values()) >= 1


def test_preparation_skips_itself_and_never_overwrites(tmp_path, shakespeare_store):
    train = _write(tmp_path / "train.jsonl", [{"prompt": f"Q{i}", "response": f"A{i}"} for i in range(20)])
    tok = shakespeare_store / "tokenizer.model"
    first = _prepare(tmp_path, train, tok)
    before = (tmp_path / "prepared" / "train" / "tokens.npy").stat().st_mtime_ns
    logged = []
    assert _prepare(tmp_path, train, tok, log=logged.append) == first
    assert logged == [f"prepared data in {tmp_path / 'prepared'} is up to date (skipped)"]
    assert (tmp_path / "prepared" / "train" / "tokens.npy").stat().st_mtime_ns == before
    with pytest.raises(PreparedDataError, match="different inputs or settings"):
        _prepare(tmp_path, train, tok, seq_len=96)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(PreparedDataError, match="holds no prepared data of this kind"):
        prepare_sft(tmp_path / "other", train_file=train, eval_file="", tokenizer_path=tok, template="alpaca",
                    seq_len=64, overlong="truncate", eval_fraction=0.2, seed=0, log=lambda *_: None)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    rows = PreparedRows(tmp_path / "prepared", "train", seed=0)
    epoch0 = rows.get_rows(np.arange(len(rows)))["tokens"]
    epoch1 = rows.get_rows(np.arange(len(rows), 2 * len(rows)))["tokens"]
    assert sorted(map(tuple, epoch0)) == sorted(map(tuple, epoch1))  # each epoch visits every row once


def test_base_fingerprint_is_mesh_independent_and_sensitive():
    params = nnx.state(build_model(MODEL, F32, jax.random.key(1)), nnx.Param)
    prints = set()
    for shape in ((8, 1, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2)):
        mesh = make_mesh(MeshConfig(*shape))
        prints.add(fingerprint(jax.device_put(params, sharding_tree(params, mesh))))
    assert len(prints) == 1
    leaf = params["layers"]["mlp"]["down_proj"]
    leaf.set_value(leaf.get_value().at[1, 2, 3].add(1e-7))  # one element, at the float32 rounding level
    assert fingerprint(params) not in prints


def test_model_chat_template_is_rendered_by_transformers(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_tokenizer import _train_bpe

    tok = load_tokenizer(_train_bpe(tmp_path / "hf" / "tokenizer.json"))
    reference = tok.as_transformers()
    pieces = render("model", CHAT, tok)
    assert "".join(p.text for p in pieces) == reference.apply_chat_template(CHAT, tokenize=False)
    assert [p.text for p in pieces if p.response] == ["A Montague.</s>", "A Capulet.</s>"]
    assert "".join(p.text for p in prompt_pieces(pieces)) == reference.apply_chat_template(
        CHAT[:-1], tokenize=False, add_generation_prompt=True)
    ids, mask = encode(pieces, tok)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "A Montague.A Capulet."
    assert ids[0] == tok.bos_id and not mask[0]  # the template's own BOS, not trained on


def test_sft_data_with_a_tokenizer_json_and_its_chat_template(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_tokenizer import _train_bpe

    tok_path = _train_bpe(tmp_path / "hf" / "tokenizer.json")
    train = _write(tmp_path / "train.jsonl", [{"messages": CHAT}] + [
        {"prompt": f"Who speaks line {i}?", "response": f"ROMEO {i}."} for i in range(9)])
    manifest = _prepare(tmp_path, train, tok_path, template="model", eval_fraction=0.3, seq_len=128)
    assert manifest["tokenizer"] == "tokenizer.json"
    assert (tmp_path / "prepared" / "tokenizer_config.json").is_file()
    tok = load_tokenizer(tmp_path / "prepared" / "tokenizer.json")
    responses = []
    for split in ("train", "eval"):
        rows = PreparedRows(tmp_path / "prepared", split, shuffle=False).get_rows(np.arange(manifest["splits"][split]["rows"]))
        for r in range(len(rows["tokens"])):
            for s in range(1, rows["segment_ids"][r].max() + 1):
                at = (rows["segment_ids"][r] == s) & (rows["loss_mask"][r] == 1)
                responses.append(tok.decode(rows["targets"][r][at]))
    expected = ["A Montague.A Capulet."] + [f"ROMEO {i}." for i in range(9)]
    assert sorted(responses) == sorted(expected)


def test_a_concurrent_preparation_of_the_same_data_is_accepted(tmp_path, shakespeare_store, monkeypatch):
    import jaxllm.data.row_prep as row_prep

    train = _write(tmp_path / "train.jsonl", [{"prompt": f"Q{i}", "response": f"A{i}"} for i in range(20)])
    tok = shakespeare_store / "tokenizer.model"
    first = _prepare(tmp_path, train, tok)
    real, calls = row_prep.existing_manifest, []

    def checked_before_the_other_process_committed(output, data_format):
        calls.append(output)
        return None if len(calls) == 1 else real(output, data_format)

    monkeypatch.setattr(row_prep, "existing_manifest", checked_before_the_other_process_committed)
    assert _prepare(tmp_path, train, tok) == first  # its rename fails; the committed data is the same
    calls.clear()
    with pytest.raises(PreparedDataError, match="another process with different data"):
        _prepare(tmp_path, train, tok, seq_len=96)
    assert real(tmp_path / "prepared", "jaxllm.sft") == first  # untouched


CHAT_TEMPLATES = ROOT / "tests" / "data" / "chat_templates"  # each family's tokenizer_config.json (special tokens)


def _family_tokenizer(directory, name):
    """A byte-level BPE tokenizer.json with the special tokens of family `name`'s tokenizer_config.json fixture
    (tests/data/chat_templates/<name>/), which sits beside it."""
    from test_hf_tokenizer import _train_bpe

    config = json.loads((CHAT_TEMPLATES / name / "tokenizer_config.json").read_text())
    named = [config[k] for k in ("pad_token", "bos_token", "eos_token", "unk_token") if config.get(k)]
    specials = list(dict.fromkeys(named + config["additional_special_tokens"]))
    return _train_bpe(directory / "tokenizer.json", specials=specials, config=config), config


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_s_chat_template_renders_as_transformers_and_ends_a_turn_where_sampling_stops(tmp_path, name):
    """SFT with the `model` template on a tokenizer that carries family `name`'s chat template and special tokens
    (as its tokenizer_config.json ships them): the conversation renders as transformers renders it, the prompt
    is its generation prompt, each response is trained up to and including the template's end-of-turn token,
    and generation (SFT evaluation, RL rollouts) stops at that token as well as at the EOS."""
    transformers = pytest.importorskip("transformers")
    path, config = _family_tokenizer(tmp_path, name)
    assert config["chat_template"] == FAMILIES[name].chat_template  # the fixture holds the template jaxllm ships
    tok = load_tokenizer(path)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    pieces = render("model", CHAT, tok)
    assert "".join(p.text for p in pieces) == reference.apply_chat_template(CHAT, tokenize=False)
    assert "".join(p.text for p in prompt_pieces(pieces)) == reference.apply_chat_template(
        CHAT[:-1], tokenize=False, add_generation_prompt=True)
    ids, mask = encode(pieces, tok)
    assert tok.decode([i for i, m in zip(ids, mask) if m]).replace("\n", "") == "A Montague.A Capulet."
    stops = stop_ids("model", tok)
    turn_end = reference.convert_ids_to_tokens(list(stops))[-1]
    assert stops[0] == tok.eos_id and turn_end == TURN_ENDS[name], (stops, turn_end)
    trained = [i for i, m in zip(ids, mask) if m]
    assert sum(i == stops[-1] for i in trained) == 2  # each response ends with it: what the model learns to emit
    assert stop_ids("chatml", tok) == (tok.eos_id,)  # a built-in template ends its responses with the EOS


# Where an assistant turn ends in each family's chat template.
TURN_ENDS = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "mistral": "</s>",
             "gemma3": "<end_of_turn>", "mixtral": "</s>", "qwen2_moe": "<|im_end|>", "qwen3_moe": "<|im_end|>"}
