"""Evaluation of a trained model: held-out perplexity on a token store and multiple-choice accuracy.

Also the shared loader for a jaxllm checkpoint as a standalone model (`load_checkpoint`): the model config is
read from the checkpoint's metadata and only the parameters are restored (never the optimizer state), so
scripts (export, generate, eval) work on any run's checkpoint regardless of its optimizer or mesh.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

import jax
import numpy as np

from jaxllm.model.head import next_token_loss
from jaxllm.eval.scoring import Scored, score
from jaxllm.data.pipeline import make_eval_batches
from jaxllm.train.step import batch_sharding, jit_eval_step, make_eval_step


# ------------------------------------------------------------------------------------------- perplexity


def perplexity(graphdef, params, mesh, store_path, *, split: str = "eval", seq_len: int = 128,
               batch_size: int = 8, max_batches: int | None = None) -> dict:
    """Token-weighted held-out loss over `loss_mask` (packing-aware) and its exponential."""
    batches = make_eval_batches(store_path, split=split, batch_size=batch_size, seq_len=seq_len,
                                max_batches=max_batches)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    with jax.set_mesh(mesh):
        step = jit_eval_step(make_eval_step(graphdef, next_token_loss), param_shardings, mesh)
        sharding = batch_sharding(mesh)
        total, count = 0.0, 0.0
        for batch in batches:
            batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
            s, c = jax.device_get(step(params, batch))
            total += float(s)
            count += float(c)
    if count == 0:
        raise ValueError(f"split {split!r} of {store_path} has no tokens to evaluate")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count), "batches": len(batches)}


# ------------------------------------------------------------------------------------- multiple choice


def read_choices(path) -> list[dict]:
    """JSON lines with `question`, `choices` (list of strings) and `answer` (index)."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            question, choices, answer = item["question"], list(item["choices"]), int(item["answer"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected {{question, choices, answer}}: {exc}") from None
        if not choices or not 0 <= answer < len(choices):
            raise ValueError(f"{path}:{n}: answer {answer} is not an index into {len(choices)} choices")
        items.append({"question": question, "choices": choices, "answer": answer})
    return items


def encode_choice(tokenizer, question: str, choice: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids): the continuation is what `question + choice` adds to `question`."""
    context = [tokenizer.bos_id] + tokenizer.encode(question)
    full = [tokenizer.bos_id] + tokenizer.encode(question + choice)
    if full[:len(context)] == context and len(full) > len(context):
        return context, full[len(context):]
    return context, tokenizer.encode(choice)


def continuation_logprobs(graphdef, params, mesh, pairs: Sequence[tuple[list[int], list[int]]]) -> list[float]:
    """Summed log-likelihood of each continuation given its context, the pairs scored together in packed rows
    (jaxllm/eval/scoring.py)."""
    if any(len(cont) == 0 for _, cont in pairs):
        raise ValueError("a choice encodes to no tokens")
    requests = [Scored((ctx + cont)[:-1], (ctx + cont)[1:], len(cont)) for ctx, cont in map(_lists, pairs)]
    longest = max((len(r.inputs) for r in requests), default=1)
    return [logp for logp, _ in score(graphdef, params, mesh, requests, max_length=longest, rows_per_call=1)]


def _lists(pair) -> tuple[list[int], list[int]]:
    return list(pair[0]), list(pair[1])


def multiple_choice(graphdef, params, mesh, tokenizer, items: Iterable[dict]) -> dict:
    """Accuracy in percent by summed log-likelihood, per-token mean and per-character (`norm`) of each choice."""
    items = list(items)
    right = right_token = right_char = 0
    for item in items:
        pairs = [encode_choice(tokenizer, item["question"], c) for c in item["choices"]]
        scores = np.asarray(continuation_logprobs(graphdef, params, mesh, pairs))
        per_token = scores / np.asarray([len(cont) for _, cont in pairs])
        per_char = scores / np.asarray([max(len(c), 1) for c in item["choices"]])
        right += int(np.argmax(scores) == item["answer"])
        right_token += int(np.argmax(per_token) == item["answer"])
        right_char += int(np.argmax(per_char) == item["answer"])
    n = max(len(items), 1)
    return {"mc_accuracy": 100.0 * right / n, "mc_accuracy_norm": 100.0 * right_char / n,
            "mc_accuracy_per_token": 100.0 * right_token / n, "mc_questions": len(items)}
