"""Task metrics of a generating model: greedy responses to held-out prompts, scored by exact match and by corpus
BLEU (sacrebleu), per task (each example's "task" field) and over all examples.

Exact match compares the response and the reference with surrounding whitespace stripped (percent). BLEU is
sacrebleu's corpus BLEU with its default 13a tokenisation, as reported in papers (a hand-written BLEU would not be
comparable), on its 0-100 scale. It is reported only for free text: a group whose references have a median of
fewer than BLEU_ORDER words (one-word answers, labels) has no 4-grams to match, and its BLEU (15 for one-word
answers where exact match read 0.3%) would say nothing; its "bleu" is None.
"""

from __future__ import annotations

from typing import Sequence

import jax

from jaxllm.model.sample import generate

GENERATE_BATCH = 64  # prompts decoded together (bounds the KV cache of large models)
BLEU_ORDER = 4  # sacrebleu's highest n-gram order: shorter references are not free text to BLEU
ALL = "all"


def responses(graphdef, variables, mesh, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              max_len: int, stop_ids: Sequence[int]) -> list[str]:
    """Greedy responses (stopping at any of `stop_ids`: jaxllm.data.sft_template.stop_ids of the prompts'
    template) to token-id prompts, each cut to its last `max_len - max_new_tokens` tokens so that prompt and
    response fit the model's trained length."""
    window = max(1, max_len - max_new_tokens)
    out: list[str] = []
    with jax.set_mesh(mesh):
        for start in range(0, len(prompts), GENERATE_BATCH):
            chunk = [list(p)[-window:] for p in prompts[start:start + GENERATE_BATCH]]
            new = generate((graphdef, variables), chunk, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                           vocab_limit=tokenizer.vocab_size)
            out += [tokenizer.decode(ids) for ids in new]
    return out


def score(hypotheses: Sequence[str], examples: Sequence[dict]) -> dict:
    """{task: {"examples", "exact_match" (%), "bleu" (0-100, None unless free text)}} for each task and "all"."""
    import sacrebleu

    groups: dict[str, list[int]] = {ALL: list(range(len(examples)))}
    for i, example in enumerate(examples):
        groups.setdefault(example.get("task", "default"), []).append(i)
    result = {}
    for task, members in groups.items():
        hyps = [hypotheses[i].strip() for i in members]
        refs = [examples[i]["reference"].strip() for i in members]
        exact = sum(h == r for h, r in zip(hyps, refs))
        free_text = bool(refs) and sorted(len(r.split()) for r in refs)[len(refs) // 2] >= BLEU_ORDER
        result[task] = {"examples": len(members), "exact_match": 100.0 * exact / max(len(members), 1),
                        "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score if free_text else None}
    return result


def evaluate_task(graphdef, variables, mesh, tokenizer, examples: Sequence[dict], *, max_new_tokens: int,
                  max_len: int, stop_ids: Sequence[int]) -> dict:
    """Scores (see `score`) of the model on examples {"prompt_ids", "reference", "task"}, plus the first
    responses (under "samples") for a look at what the model says; generation stops at `stop_ids`."""
    hyps = responses(graphdef, variables, mesh, tokenizer, [e["prompt_ids"] for e in examples],
                     max_new_tokens=max_new_tokens, max_len=max_len, stop_ids=stop_ids)
    samples = [{"task": e.get("task", "default"), "reference": e["reference"], "response": h}
               for e, h in zip(examples[:3], hyps)]
    return {"scores": score(hyps, examples), "samples": samples}


