"""Prompts for RL post-training (PPO, GRPO): JSON lines of `{"prompt": "..."}`, or `{"messages": [...]}` ending
with a user turn, rendered with the SFT template (jaxllm.data.sft_template) up to the opening of the assistant's
turn, so a policy fine-tuned on that template continues them as it was trained to. Other fields of a record
(`"task"`, or anything a reward function wants) are kept with it.

Lines that are not JSON or not a usable prompt are counted and skipped with their line numbers, as in SFT.
"""

from __future__ import annotations


from jaxllm.data import row_prep
from jaxllm.data.sft_template import checked_messages, encode, prompt_pieces, render


def _messages(record) -> list[dict]:
    """The conversation before the response; raises ValueError with the reason a record is unusable."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    if "messages" in record:
        return checked_messages(record["messages"], "user",
                                "the last message must be the user's: the response is what the policy writes")
    if not isinstance(record.get("prompt"), str) or not record["prompt"]:
        raise ValueError("missing field 'prompt' (a non-empty string)")
    return [{"role": "user", "content": record["prompt"]}]


def _parse(record) -> dict:
    return {"messages": _messages(record), "record": record}


def prompt_text(messages: list[dict]) -> str:
    """The text a reward function is given as the prompt: the last user turn's content."""
    return messages[-1]["content"]


def encode_prompts(parsed: list[dict], tokenizer, template: str, max_tokens: int) -> tuple[list[dict], int]:
    """({"prompt_ids", "prompt", "record"} per prompt of at most `max_tokens` tokens, how many were longer and
    dropped)."""
    out, too_long = [], 0
    for item in parsed:
        pieces = render(template, item["messages"] + [{"role": "assistant", "content": ""}], tokenizer)
        ids = encode(prompt_pieces(pieces), tokenizer)[0]
        if len(ids) > max_tokens:
            too_long += 1
            continue
        out.append({"prompt_ids": ids, "prompt": prompt_text(item["messages"]), "record": item["record"]})
    return out, too_long


def read_prompts(train_file, eval_file, eval_fraction: float, seed: int, tokenizer, template: str,
                 max_tokens: int, log=print) -> dict[str, list[dict]]:
    """{"train", "eval"}: the encoded prompts of both files (or a seeded `eval_fraction` of the train file held
    out); skipped lines and dropped prompts are reported through `log`."""
    skipped: list[dict] = []
    splits = row_prep.read_splits(train_file, eval_file, eval_fraction, seed, _parse, skipped)
    out = {}
    for name, parsed in splits.items():
        out[name], too_long = encode_prompts(parsed, tokenizer, template, max_tokens)
        log(f"prompts {name}: {len(out[name])} usable" + (f", {too_long} longer than {max_tokens} tokens dropped"
                                                           if too_long else ""))
    for s in skipped[:row_prep.MAX_REPORTED_LINES]:
        log(f"skipped {s['file']} line {s['line']}: {s['reason']}")
    if skipped:
        log(f"skipped {len(skipped)} unusable lines in all")
    return out
