"""Build the data of the offline lm-evaluation-harness task pack eval_tasks/: `python scripts/make_eval_tasks.py`.

The perplexity, MC and cloze passages come from the scenes of data/shakespeare.jsonl.gz that `make train` holds out:
the `eval` split of scripts/prepare_data.py with make train's settings (its clean and dedup steps with the default
thresholds, then jaxllm.data.prepare.split_train_eval, a seeded hash of each cleaned text: 2%, seed 0), 24 scenes of
14 plays. `make sft` trains on examples from 22 of them (its own split hashes the document id): no MC or cloze passage
shares a line with those examples (a speech with a line in a train example of its scene is not used), and the
distractors come from the same speeches. Files (JSON lines; `doc` is the scene's document id):

    shakespeare_ppl.jsonl    {"doc", "text"}  each held-out scene, cleaned as make train's store holds it, cut at a
                             paragraph boundary to at most PPL_MAX_CHARS characters (loglikelihood_rolling)
    shakespeare_mc.jsonl     {"doc", "context", "choices", "label"}  a speaker's name and three lines of a speech (two
                             or one where three would not fit MAX_ITEM_CHARS with the choices), taken run after run
                             through each speech; the choices are the speech's next two lines and three distractors:
                             two consecutive lines of a speech of another held-out play with the same indentation and
                             capitalisation line by line (prose to prose, verse to verse), within 10% in length (20%
                             when none is), drawn by make_preference_set.Pool; shuffled (seeded), `label` the true one
    shakespeare_cloze.jsonl  {"doc", "context", "word"}  LAMBADA-style: a speaker's name and the lines of a speech up to
                             the first one after its first that ends a sentence, at most MAX_ITEM_CHARS characters;
                             `word` is that line's last word (letters only, at least MIN_WORD_CHARS), `context` what
                             precedes it (less the space before it; the punctuation after it is dropped)
    sft_{form,title,next_line}.jsonl  {"prompt", "response", "task"}  the held-out examples of the shipped SFT task:
                             make_sft_task.py's eval.jsonl (its defaults), each kind in its order there. They are held
                             out of make sft; their scenes are (but for 2 of 126) in make train's train split, as
                             for make sft's own evaluation, so `next_line` and `title` also reward recall of
                             pretraining text. Rendered at evaluation time with the alpaca template
                             (eval_tasks/_sft_template_yaml)

MC and cloze items: at most PER_SCENE per scene, spread evenly over its candidates (make_sft_task._spread). All of
these fit the 128 tokens of the make train model (MAX_ITEM_CHARS); the SFT prompts fit make sft's 256. Deterministic:
the same corpus gives the same bytes (tests/test_eval_tasks.py checks the committed files against a rebuild).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import io
import json
import random
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_sft_task  # noqa: E402
from jaxllm.data.clean import clean_documents  # noqa: E402
from jaxllm.data.dedup import find_duplicates  # noqa: E402
from jaxllm.data.prep_config import load_config  # noqa: E402
from jaxllm.data.prepare import split_train_eval  # noqa: E402
from jaxllm.objectives.reward_fns import ends_a_sentence  # noqa: E402
from make_preference_set import Pool, _usable  # noqa: E402
from make_sft_task import _spread, examples_of, speeches, write_jsonl  # noqa: E402

# make train's split: scripts/prepare_data.py's defaults (the Makefile passes neither --eval_fraction nor --seed)
PRETRAIN_EVAL_FRACTION, PRETRAIN_SEED = 0.02, 0
# make sft's split: scripts/make_sft_task.py's defaults
SFT_EVAL_FRACTION, SFT_SEED = 0.1, 0
SEED = 0  # the MC distractors and choice order
PPL_MAX_CHARS = 3000
# An MC context with its longest choice, a cloze passage: with the make-train tokenizer (~1.7 characters a token)
# within the 128 tokens of the make train model (as make_preference_set.py's MAX_EXAMPLE_CHARS)
MAX_ITEM_CHARS = 200
MIN_WORD_CHARS = 3
PER_SCENE = {"mc": 8, "cloze": 8}
FILES = ("shakespeare_ppl.jsonl", "shakespeare_mc.jsonl", "shakespeare_cloze.jsonl", "sft_form.jsonl",
         "sft_title.jsonl", "sft_next_line.jsonl")
_LAST_WORD = re.compile(r" ([A-Za-z]+)([^A-Za-z0-9 ]*)$")


def pretrain_split(corpus: str) -> dict[str, tuple[str, str]]:
    """{document id: ("train" or "eval", cleaned text)} of the documents make train's store keeps, as
    scripts/prepare_data.py splits them (its clean, dedup and split steps, default thresholds)."""
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    cfg = load_config()
    cleaned = [(d["id"], text) for d, (text, reason) in zip(docs, clean_documents([d["text"] for d in docs], cfg.clean))
               if reason is None]
    keep = find_duplicates([text for _, text in cleaned], **dataclasses.asdict(cfg.dedup)).keep
    kept = [c for c, k in zip(cleaned, keep) if k]
    _, held = split_train_eval([text for _, text in kept], PRETRAIN_EVAL_FRACTION, PRETRAIN_SEED)
    held = set(held)
    return {doc_id: ("eval" if text in held else "train", text) for doc_id, text in kept}


def sft_scenes(corpus: str) -> dict[str, tuple[str, str, str]]:
    """{document id: (make sft's split, play, text)} of the 37 plays' documents (make_sft_task.play_documents)."""
    args = argparse.Namespace(corpus=corpus, eval_fraction=SFT_EVAL_FRACTION, seed=SFT_SEED)
    return {doc_id: (split, play, text) for split, doc_id, play, text in make_sft_task.play_documents(args)}


def example_lines(example: dict) -> list[str]:
    """The corpus lines an SFT example holds (its prompt less the instruction line, and its response)."""
    return example["prompt"].split("\n")[1:] + example["response"].split("\n")


def cut_at_paragraph(text: str, limit: int) -> str:
    """The longest run of `text`'s first paragraphs within `limit` characters (at least its first paragraph's
    first `limit` characters)."""
    paragraphs = text.split("\n\n")
    kept, size = [], -2
    for p in paragraphs:
        if size + 2 + len(p) > limit:
            break
        kept.append(p)
        size += 2 + len(p)
    return "\n\n".join(kept) if kept else text[:limit]


def mc_items(speech: list[str]) -> list[tuple[list[str], str]]:
    """(context lines: the name and three lines, or two or one where three would not fit MAX_ITEM_CHARS; the next
    two lines) of a speech, one run of usable lines after another."""
    name, body = speech[0], speech[1:]
    items, i = [], 0
    while i + 3 <= len(body):
        for k in (3, 2, 1):
            lines = body[i:i + k + 2]
            context, answer = [name] + lines[:k], "\n".join(lines[k:])
            if (len(lines) == k + 2 and all(map(_usable, lines))
                    and len("\n".join(context)) + 1 + len(answer) <= MAX_ITEM_CHARS):
                items.append((context, answer))
                i += k + 2
                break
        else:
            i += 1
    return items


def cloze_item(speech: list[str]) -> tuple[str, str] | None:
    """(context, word) of a speech (see the module docstring), or None."""
    name, body = speech[0], speech[1:]
    for j in range(1, len(body)):
        passage = "\n".join([name] + body[:j + 1])
        if not all(map(_usable, body[:j + 1])) or len(passage) > MAX_ITEM_CHARS:
            return None
        if ends_a_sentence(body[j]):
            found = _LAST_WORD.search(body[j])
            if found is None or len(found.group(1)) < MIN_WORD_CHARS:
                return None
            return passage[:len(passage) - len(found.group(0))], found.group(1)
    return None


def build(corpus: str) -> dict[str, list[dict]]:
    """The rows of each file of FILES."""
    split = pretrain_split(corpus)
    plays = sft_scenes(corpus)
    scenes = [(doc_id, text) for doc_id, (name, text) in split.items() if name == "eval"]
    # The lines of make sft's train examples of each held-out scene (the scene's own examples_of, as make_sft_task
    # writes them to train.jsonl when its split is "train").
    sft_train_lines = {}
    for doc_id, _ in scenes:
        sft_split, play, raw = plays[doc_id]
        sft_train_lines[doc_id] = ({line for e in sum(examples_of(play, raw).values(), []) for line in example_lines(e)}
                                   if sft_split == "train" else set())

    def free(doc_id: str, lines: list[str]) -> bool:
        return not sft_train_lines[doc_id].intersection(lines)

    rows: dict[str, list[dict]] = {name: [] for name in FILES}
    pool, usable = Pool(), {}
    for doc_id, text in scenes:
        rows["shakespeare_ppl.jsonl"].append({"doc": doc_id, "text": cut_at_paragraph(text, PPL_MAX_CHARS)})
        usable[doc_id] = [s for s in speeches(text) if free(doc_id, s[1:])]
        for speech in usable[doc_id]:
            pool.add(plays[doc_id][1], speech)
    pool.freeze()
    for doc_id, _ in scenes:
        play = plays[doc_id][1]
        found = [item for speech in usable[doc_id] for item in mc_items(speech)]
        for context, answer in _spread(found, PER_SCENE["mc"]):
            rng = random.Random(f"{SEED}\0{doc_id}\0{answer}")
            room = MAX_ITEM_CHARS - len("\n".join(context)) - 1
            choices = [answer]
            for _ in range(64):  # Pool.draw: one of the matching pairs of other plays, at random
                drawn = pool.draw(answer, play, room, rng) if len(choices) < 4 else None
                if drawn is None:
                    break
                if drawn not in choices:
                    choices.append(drawn)
            if len(choices) < 4:  # too few lines of that shape and length
                continue
            rng.shuffle(choices)
            rows["shakespeare_mc.jsonl"].append({"doc": doc_id, "context": "\n".join(context), "choices": choices,
                                                 "label": choices.index(answer)})
        found = [item for item in map(cloze_item, usable[doc_id]) if item is not None]
        for context, word in _spread(found, PER_SCENE["cloze"]):
            rows["shakespeare_cloze.jsonl"].append({"doc": doc_id, "context": context, "word": word})
    # The SFT task's held-out examples: make_sft_task's eval.jsonl, each kind in its order there.
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        if make_sft_task.main(["--corpus", corpus, "--out", tmp]) != 0:
            raise RuntimeError("make_sft_task.py failed")
        examples = [json.loads(line) for line in (Path(tmp) / "eval.jsonl").read_text().splitlines()]
    for kind in make_sft_task.PER_DOCUMENT:
        rows[f"sft_{kind}.jsonl"] = [e for e in examples if e["task"] == kind]
    return rows


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="data/shakespeare.jsonl.gz")
    p.add_argument("--out", default="eval_tasks/data", help="directory for the task files")
    args = p.parse_args(argv)
    if not Path(args.corpus).is_file():
        print(f"error: --corpus: no such file {args.corpus}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in build(args.corpus).items():
        write_jsonl(out / name, rows)
        print(f"{out / name}: {len(rows)} docs, {(out / name).stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
