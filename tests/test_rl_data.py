"""RL prompt data (jaxllm/data/prompts.py), its length buckets (jaxllm/objectives/rl.py) and the reward-function
registry (jaxllm/objectives/reward_fns.py)."""

import json

import pytest

from jaxllm.data.prompts import read_prompts
from jaxllm.data.sft import encode_examples
from jaxllm.data.sft_template import encode, prompt_pieces, render
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.objectives import reward_fns as rewards
from jaxllm.objectives.rl import prompt_bucket


@pytest.fixture(scope="module")
def tokenizer(shakespeare_store):
    return load_tokenizer(shakespeare_store / "tokenizer.model")


def _write(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.mark.parametrize("template", ["alpaca", "chatml"])
def test_prompts_tokenise_as_the_sft_prefix(tmp_path, tokenizer, template):
    """A prompt encodes exactly as the prompt part of an SFT example with that prompt: the policy continues the
    tokens it was fine-tuned to continue."""
    train = _write(tmp_path / "train.jsonl", [
        {"prompt": "Continue the speech.\nHAMLET.\nTo be, or not to be", "task": "speech"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]}])
    got = read_prompts(train, train, 0.0, 0, tokenizer, template, max_tokens=256, log=lambda *a: None)["train"]
    assert [g["prompt"] for g in got] == ["Continue the speech.\nHAMLET.\nTo be, or not to be", "Say hi."]
    assert got[0]["record"]["task"] == "speech"  # extra fields travel with the prompt, for reward functions
    sft = encode_examples([([{"role": "user", "content": got[0]["prompt"]},
                             {"role": "assistant", "content": "Whether 'tis nobler"}], "speech")],
                          tokenizer, template, 256, "drop")
    assert sft.prompts[0]["prompt_ids"] == got[0]["prompt_ids"]
    ids, mask = sft.examples[0]
    assert ids[: len(got[0]["prompt_ids"])] == got[0]["prompt_ids"] and not any(mask[: len(got[0]["prompt_ids"])])
    system = render(template, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                               {"role": "assistant", "content": ""}], tokenizer)
    assert got[1]["prompt_ids"] == encode(prompt_pieces(system), tokenizer)[0]


def test_bad_lines_are_counted_and_skipped_with_their_numbers(tmp_path, tokenizer):
    train = _write(tmp_path / "train.jsonl", [
        {"prompt": "Good."}, "{not json", {"prompt": ""}, {"text": "no prompt"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "narrator", "content": "x"}]}, {"prompt": "word " * 400}, {"prompt": "Fine."}])
    held_out = _write(tmp_path / "eval.jsonl", [{"prompt": "Held."}])
    logged = []
    got = read_prompts(train, held_out, 0.0, 0, tokenizer, "alpaca", max_tokens=64, log=logged.append)["train"]
    assert [g["prompt"] for g in got] == ["Good.", "Fine."]
    text = "\n".join(logged)
    for number, reason in ((2, "not valid JSON"), (3, "missing field 'prompt'"), (4, "missing field 'prompt'"),
                           (5, "the last message must be the user's"), (6, "each message needs a role")):
        assert f"line {number}: {reason}" in text, text
    assert "1 longer than 64 tokens dropped" in text and "skipped 5 unusable lines in all" in text


def test_registry_resolves_registered_functions_and_names_the_others():
    assert rewards.resolve("fn:ends_sentence")("p", "To be.\nOr not.") == 1.0
    assert rewards.resolve("fn:ends_sentence")("p", "To be, or") == 0.0
    assert rewards.resolve("fn:single_line")("p", "One line.") == 1.0
    assert rewards.resolve("fn:single_line")("p", "Two\nlines") == 0.0

    @rewards.register("test_rl_data_length")
    def length(prompt, response):
        return len(response) / 10

    try:
        assert rewards.resolve("fn:test_rl_data_length")("p", "abcde") == 0.5
        with pytest.raises(ValueError, match="registered already"):
            rewards.register("test_rl_data_length")(lambda p, r: 0.0)
    finally:
        del rewards.REWARDS["test_rl_data_length"]
    with pytest.raises(ValueError, match=r"no reward function 'nope'; registered: ends_sentence, single_line"):
        rewards.resolve("fn:nope")
    with pytest.raises(ValueError, match="expected fn:<name>"):
        rewards.resolve("ends_sentence")
    assert rewards.resolve("fn:jaxllm.objectives.reward_fns:single_line") is rewards.single_line  # a module's function
    with pytest.raises(ValueError, match="cannot import reward module 'no_such_module'"):
        rewards.resolve("fn:no_such_module:f")
    with pytest.raises(ValueError, match="module 'jaxllm.objectives.reward_fns' has no reward function 'nope'"):
        rewards.resolve("fn:jaxllm.objectives.reward_fns:nope")


def test_an_iterations_prompts_pad_to_its_bucket():
    """Rows are as long as the iteration's longest prompt rounded up to 32 tokens, never past max_prompt_tokens
    rounded up: short prompts cost short rows."""
    assert [prompt_bucket(n, 128) for n in (1, 31, 32, 33, 65, 96, 97, 128)] == [32, 32, 32, 64, 96, 96, 128, 128]
    assert prompt_bucket(90, 80) == 96 and prompt_bucket(20, 80) == 32 and prompt_bucket(20, 20) == 32
