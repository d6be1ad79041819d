"""Build the shipped SFT task from the shipped corpus: `python scripts/make_sft_task.py --out build/data/sft_task`.

Three kinds of examples, from the 37 plays of data/shakespeare.jsonl.gz (the sonnets and poems are left out):

    form       "Is this passage verse or prose?\\n<three or four lines of one speech>"  ->  "verse" / "prose"
    title      "Which play is this passage from?\\n<consecutive speeches>"             ->  "Hamlet"
    next_line  "Give the next line.\\n<a speaker's name and two lines of a speech>"    ->  its next line

`form` is labelled by the printed lines: verse when every line opens with a capital letter (Shakespeare's verse
lines always do), prose when a line after the first opens in lower case (a sentence running on past the margin);
other passages are not used, and each document gives as many verse as prose examples, so always answering one
label scores 50%. A title passage is consecutive speeches cut at a line boundary to at most 150 characters.

Held-out examples come from held-out scenes (documents chosen by a seeded hash, `--eval_fraction`), so no passage
of the eval file is in the train file; the eval file is shuffled (seeded) and then alternates the tasks, so its
first examples already mix plays and tasks. Writes train.jsonl and eval.jsonl
as {"prompt", "response", "task"} lines. Deterministic: the same corpus gives the same files.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import sys
from pathlib import Path
from typing import Iterator

TITLES = {
    "alls_well_that_ends_well": "All's Well That Ends Well", "antony_and_cleopatra": "Antony and Cleopatra",
    "as_you_like_it": "As You Like It", "comedy_of_errors": "The Comedy of Errors", "coriolanus": "Coriolanus",
    "cymbeline": "Cymbeline", "hamlet": "Hamlet", "henry_iv_part_1": "Henry IV, Part 1",
    "henry_iv_part_2": "Henry IV, Part 2", "henry_v": "Henry V", "henry_vi_part_1": "Henry VI, Part 1",
    "henry_vi_part_2": "Henry VI, Part 2", "henry_vi_part_3": "Henry VI, Part 3", "henry_viii": "Henry VIII",
    "john": "King John", "julius_caesar": "Julius Caesar", "lear": "King Lear",
    "loves_labours_lost": "Love's Labour's Lost", "macbeth": "Macbeth", "measure_for_measure": "Measure for Measure",
    "merchant_of_venice": "The Merchant of Venice", "merry_wives_of_windsor": "The Merry Wives of Windsor",
    "midsummer_nights_dream": "A Midsummer Night's Dream", "much_ado_about_nothing": "Much Ado About Nothing",
    "othello": "Othello", "pericles": "Pericles", "richard_ii": "Richard II", "richard_iii": "Richard III",
    "romeo_and_juliet": "Romeo and Juliet", "taming_of_the_shrew": "The Taming of the Shrew",
    "tempest": "The Tempest", "timon_of_athens": "Timon of Athens",
    "tragedy_of_titus_andronicus": "Titus Andronicus", "troilus_and_cressida": "Troilus and Cressida",
    "twelfth_night": "Twelfth Night", "two_gentlemen_of_verona": "The Two Gentlemen of Verona",
    "winters_tale": "The Winter's Tale",
}
TITLE_PROMPT = "Which play is this passage from?\n"
FORM_PROMPT = "Is this passage verse or prose?\n"
NEXT_LINE_PROMPT = "Give the next line.\n"
MAX_PASSAGE_CHARS = 150  # with the make-train tokenizer (~1.7 characters a token) an example fits 128 tokens
PER_DOCUMENT = {"form": 8, "title": 1, "next_line": 1}
# A speech opens with the speaker's name alone on its line ("HAMLET." or "Laer."), then what they say.
_SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,30}\.$")


def speeches(text: str) -> list[list[str]]:
    """The document's speeches, each as its lines (name first)."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.rstrip() for line in paragraph.strip().splitlines() if line.strip()]
        if len(lines) >= 2 and _SPEAKER.match(lines[0]) and not lines[1].startswith("["):
            out.append(lines)
    return out


def _cut(lines: list[str]) -> list[str]:
    """The first lines that fit MAX_PASSAGE_CHARS."""
    kept, size = [], 0
    for line in lines:
        size += len(line) + 1
        if size > MAX_PASSAGE_CHARS:
            break
        kept.append(line)
    return kept


def _spread(candidates: list, count: int) -> list:
    """`count` candidates spread evenly over the list (deterministic)."""
    if len(candidates) <= count:
        return candidates
    return [candidates[i * len(candidates) // count] for i in range(count)]


def form_of(lines: list[str]) -> str | None:
    """'verse', 'prose', or None (neither clearly: see the module docstring)."""
    starts = [line.lstrip()[:1] for line in lines]
    if all(c.isupper() for c in starts):
        return "verse"
    return "prose" if any(c.islower() for c in starts[1:]) else None


def examples_of(play: str, text: str) -> dict[str, list[dict]]:
    parts = speeches(text)
    passages = [_cut(parts[i] + parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
    titles = [{"prompt": TITLE_PROMPT + "\n".join(p), "response": TITLES[play], "task": "title"}
              for p in passages if len(p) >= 3]
    forms: dict[str, list[dict]] = {"verse": [], "prose": []}
    for s in parts:
        body = [line for line in s[1:5] if not line.startswith("[")]
        label = form_of(body) if len(body) >= 3 else None
        if label:
            forms[label].append({"prompt": FORM_PROMPT + "\n".join(body), "response": label, "task": "form"})
    pairs = min(len(forms["verse"]), len(forms["prose"]), PER_DOCUMENT["form"] // 2)
    balanced = interleave([_spread(forms["verse"], pairs), _spread(forms["prose"], pairs)])
    lines = [{"prompt": NEXT_LINE_PROMPT + "\n".join(s[:3]), "response": s[3], "task": "next_line"}
             for s in parts if len(s) >= 4 and not s[3].startswith("[")]
    return {"form": balanced, "title": _spread(titles, PER_DOCUMENT["title"]),
            "next_line": _spread(lines, PER_DOCUMENT["next_line"])}


def held_out(doc_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.blake2b(f"{seed}\0{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64 < fraction


def interleave(groups: list[list[dict]]) -> list[dict]:
    out = []
    for i in range(max(map(len, groups))):
        out += [g[i] for g in groups if i < len(g)]
    return out


def corpus_arguments(description: str, argv) -> argparse.Namespace | None:
    """--corpus, --out, --eval_fraction, --seed (the task builders' command line); None (error printed) when the
    corpus file is missing."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--corpus", default="data/shakespeare.jsonl.gz")
    p.add_argument("--out", required=True, help="directory for train.jsonl and eval.jsonl")
    p.add_argument("--eval_fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not Path(args.corpus).is_file():
        print(f"error: --corpus: no such file {args.corpus}", file=sys.stderr)
        return None
    return args


def play_documents(args) -> Iterator[tuple[str, str, str, str]]:
    """(split, document id, play, text) of every document of the 37 plays, split by `held_out`."""
    with gzip.open(args.corpus, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            play = doc["id"].rsplit("-", 1)[0].removesuffix("_gut")
            if play in TITLES:  # not the sonnets and poems
                split = "eval" if held_out(doc["id"], args.eval_fraction, args.seed) else "train"
                yield split, doc["id"], play, doc["text"]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """All of `rows` or nothing: written beside `path`, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def main(argv) -> int:
    args = corpus_arguments(__doc__.splitlines()[0], argv)
    if args is None:
        return 2
    split = {name: {task: [] for task in PER_DOCUMENT} for name in ("train", "eval")}
    for name, _, play, text in play_documents(args):
        for task, found in examples_of(play, text).items():
            split[name][task] += found
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, tasks in split.items():
        if name == "eval":
            for i, examples in enumerate(tasks.values()):
                random.Random(args.seed + i).shuffle(examples)
        write_jsonl(out / f"{name}.jsonl", interleave(list(tasks.values())))
        print(f"{out / (name + '.jsonl')}: " + ", ".join(f"{len(v)} {k}" for k, v in tasks.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
