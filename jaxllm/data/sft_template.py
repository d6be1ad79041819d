"""Chat templates: a conversation as pieces of text, each a prompt piece (not trained on) or a response piece.

Built-in templates (`sft.template`), per turn:

    alpaca   system "{content}\\n\\n"   user "### Instruction:\\n{content}\\n\\n"
             assistant "### Response:\\n" (prompt), "{content}" + EOS (response), "\\n\\n" before a later turn
    chatml   system/user "<|im_start|>{role}\\n{content}<|im_end|>\\n"
             assistant "<|im_start|>assistant\\n" (prompt), "{content}" + EOS (response), "<|im_end|>\\n" before a
             later turn
    model    the base tokenizer's own `chat_template` (tokenizer_config.json), rendered by transformers'
             `apply_chat_template` (no Jinja is re-implemented here)

Built-in templates start with BOS; a model template renders its own special tokens. Pieces are encoded one by one,
so the prompt of an example tokenizes exactly as the prefix of its training row: generation at evaluation time
starts from the same tokens the model was trained to continue.

Most model templates have no generation markers, so an assistant turn's response is found by difference: the text
of the conversation up to and including that turn, minus the text of the conversation before it rendered with
`add_generation_prompt=True` (which must be a prefix of the former).
"""

from __future__ import annotations

from typing import NamedTuple

ROLES = ("system", "user", "assistant")


class Piece(NamedTuple):
    """Text (or, with `token`, one special token id) and whether it is response (trained on)."""

    text: str
    response: bool
    token: int | None = None


# Built-in templates: (system turn, user turn, opening of an assistant turn, text after it when a turn follows).
_FORMATS = {
    "alpaca": ("{content}\n\n", "### Instruction:\n{content}\n\n", "### Response:\n", "\n\n"),
    "chatml": ("<|im_start|>system\n{content}<|im_end|>\n", "<|im_start|>user\n{content}<|im_end|>\n",
               "<|im_start|>assistant\n", "<|im_end|>\n"),
}


def checked_messages(messages, last_role: str, last_reason: str) -> list[dict]:
    """A record's `messages` as {"role", "content"} dicts, its last turn `last_role`; ValueError with the
    reason (`last_reason` for a wrong last turn) when it is unusable."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs a role in {list(ROLES)} and a string content")
    if messages[-1]["role"] != last_role:
        raise ValueError(last_reason)
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class TemplateError(ValueError):
    """A conversation or tokenizer the template cannot render (one line)."""


def render(template: str, messages: list[dict], tokenizer) -> list[Piece]:
    """The pieces of `messages` (a validated conversation ending with an assistant turn) under `template`."""
    if template == "model":
        return _render_model(messages, tokenizer)
    system, user, opening, closing = _FORMATS[template]
    pieces = [Piece("", False, tokenizer.bos_id)]
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "assistant":
            pieces += [Piece(opening, False), Piece(content, True), Piece("", True, tokenizer.eos_id)]
            if i + 1 < len(messages):
                pieces.append(Piece(closing, False))
        else:
            pieces.append(Piece((system if role == "system" else user).format(content=content), False))
    return pieces


def conversation_text(template: str, messages: list[dict], tokenizer, add_generation_prompt: bool = True) -> str:
    """A conversation (any last turn) as one string under `template`, opening an assistant turn at the end when
    `add_generation_prompt` (what an evaluation harness feeds as a chat prompt). The built-in templates' BOS and
    EOS are tokens, not text: left out (the encoder of the prompt adds BOS); a model template renders its own."""
    if template == "model":
        if getattr(tokenizer, "as_transformers", None) is None or not getattr(tokenizer, "chat_template", None):
            raise TemplateError("'model' needs a tokenizer.json whose tokenizer_config.json has a chat_template")
        return tokenizer.as_transformers().apply_chat_template(messages, tokenize=False,
                                                               add_generation_prompt=add_generation_prompt)
    system, user, opening, closing = _FORMATS[template]
    parts = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            parts += [opening, message["content"], closing if i + 1 < len(messages) else ""]
        else:
            parts.append((system if message["role"] == "system" else user).format(content=message["content"]))
    if add_generation_prompt and (not messages or messages[-1]["role"] != "assistant"):
        parts.append(opening)
    return "".join(parts)


def _render_model(messages: list[dict], tokenizer) -> list[Piece]:
    as_transformers = getattr(tokenizer, "as_transformers", None)
    if as_transformers is None or not getattr(tokenizer, "chat_template", None):
        raise TemplateError("'model' needs a tokenizer.json whose tokenizer_config.json has a "
                            "chat_template")
    hf = as_transformers()
    text = lambda msgs, gen: hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    pieces, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = text(messages[:i], True), text(messages[: i + 1], False)
        if not (before.startswith(done) and through.startswith(before)):
            raise TemplateError("the model's chat_template does not render a conversation as a "
                                "prefix of its continuation, so response tokens cannot be found by difference")
        pieces += [Piece(before[len(done):], False), Piece(through[len(before):], True)]
        done = through
    return [p for p in pieces if p.text]


# A one-turn conversation whose response's closing tokens `stop_ids` reads (one character, so that what follows
# it in the template cannot merge with it).
_PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


def stop_ids(template: str, tokenizer) -> tuple[int, ...]:
    """The ids generation stops at under `template`: the tokenizer's EOS, and for a model template the special
    token its chat_template closes an assistant turn with when that is another one (Gemma's <end_of_turn> beside
    an <eos>, ChatML's <|im_end|> beside an <|endoftext|>, Llama 3's <|eot_id|> beside an <|end_of_text|>), as
    those models' own generation_config.json lists both. A model fine-tuned on the template ends its responses
    with that token, so sampling that stopped at the EOS alone would run past the turn."""
    eos = (tokenizer.eos_id,)
    if template != "model":
        return eos
    ids, _ = encode([p for p in _render_model(_PROBE, tokenizer) if p.response], tokenizer)
    closing = [i for i in ids[len(tokenizer.encode(_PROBE[-1]["content"])):] if tokenizer.decode([i]) == ""]
    return eos if not closing or closing[0] == tokenizer.eos_id else eos + (closing[0],)


def encode(pieces: list[Piece], tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, response mask: 1 where the token is part of a response)."""
    ids: list[int] = []
    mask: list[int] = []
    for piece in pieces:
        tokens = [piece.token] if piece.token is not None else tokenizer.encode(piece.text)
        ids += tokens
        mask += [int(piece.response)] * len(tokens)
    return ids, mask


def prompt_pieces(pieces: list[Piece]) -> list[Piece]:
    """The pieces before the last response: what generation continues at evaluation time."""
    end = len(pieces)
    while end > 0 and pieces[end - 1].response:
        end -= 1
    return pieces[:end]
