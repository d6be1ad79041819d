"""Build preference pairs from the corpus: `python scripts/make_preference_set.py --out build/data/preference`.

Each pair continues one speech of the 37 plays of data/shakespeare.jsonl.gz (the sonnets and poems are left out):

    prompt    "Continue the speech.\\n<the speaker's name>\\n<the speech's first one or two lines>"
    chosen    the speech's next two lines (c1, c2), where c1 runs on (it does not end a sentence) and c2 ends one
              (".", "!" or "?"): a continuation that stops where the speaker does
    rejected  a corruption of them, one of four kinds (the `kind` field), as many of each as the set allows:

    other_play  two consecutive lines (not a speech's first) of a speech of another play of the same split, of a
                length within 10% of the chosen's (20% when none is), with the same capitalisation of their first
                letters (verse or running prose, as the chosen); wherever they fall in their speech, so some end a
                sentence and some do not
    shuffled    the chosen's two lines swapped (c2, c1): the same characters, only the order is wrong
    repeated    the prompt's last line repeated before c1 (last, c1), or c1 repeated in place of c2 (c1, c1),
                whichever is closer in length to the chosen
    truncated   c1, then c2 cut short at a word boundary (one to a third of its words dropped): the speech stops
                mid-sentence; shorter by construction

The prompt carries two lines when the speech has them and prompt plus response stays within MAX_EXAMPLE_CHARS,
otherwise one. Lines with a stage direction ("[Aside.]") are never used. A pair whose rejected equals its chosen
is never made. Per scene-sized document one pair of each kind, each from a different speech, spread evenly over
the document (the kinds take their positions in a seeded order per document).

Held-out pairs come from held-out scenes (documents chosen by the same seeded hash as make_sft_task.py,
`--eval_fraction`), so no passage of the eval file is in the train file; other_play lines are drawn from the same
split. Each file is shuffled (seeded). Writes train.jsonl and eval.jsonl as {"prompt", "chosen", "rejected",
"kind"} lines. Deterministic: the same corpus gives the same files.
"""

from __future__ import annotations

import bisect
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jaxllm.objectives.reward_fns import ends_a_sentence  # noqa: E402
from make_sft_task import _spread, corpus_arguments, play_documents, speeches, write_jsonl  # noqa: E402

PROMPT = "Continue the speech.\n"
KINDS = ("other_play", "shuffled", "repeated", "truncated")
# prompt + "\n" + response: with the make-train tokenizer (~1.7 characters a token) a pair fits 128 tokens
MAX_EXAMPLE_CHARS = 200
MIN_LINE_WORDS = 3  # each chosen line: no half lines ("Cry.") whose corruptions say little
LENGTH_TOLERANCES = (0.1, 0.2)  # other_play: relative length difference allowed, tried in order


def _usable(line: str) -> bool:
    return bool(line.strip()) and "[" not in line and "]" not in line


def _pattern(lines) -> tuple[tuple[bool, bool], ...]:
    """Per line: whether it is indented (songs), whether it opens with a capital letter (verse lines always do;
    running prose does not)."""
    return tuple((line[:1] == " ", line.lstrip()[:1].isupper()) for line in lines)


def _shaped(c1: str, c2: str) -> bool:
    """A continuation that runs on from its first line and ends a sentence with its second."""
    return not ends_a_sentence(c1) and ends_a_sentence(c2)


def _fits(prompt: str, response: str) -> bool:
    return len(prompt) + 1 + len(response) <= MAX_EXAMPLE_CHARS


class Pool:
    """Two consecutive usable lines from speeches (not a speech's first line), by capitalisation and length."""

    def __init__(self):
        self.by_pattern: dict[tuple, list[tuple[int, str, str]]] = {}

    def add(self, play: str, speech: list[str]) -> None:
        body = speech[1:]
        for i in range(1, len(body) - 1):
            pair = body[i:i + 2]
            if all(map(_usable, pair)):
                text = "\n".join(pair)
                self.by_pattern.setdefault(_pattern(pair), []).append((len(text), text, play))

    def freeze(self) -> None:
        for entries in self.by_pattern.values():
            entries.sort()

    def draw(self, chosen: str, play: str, room: int, rng: random.Random) -> str | None:
        """A pair of another play, length-matched to `chosen`, at most `room` characters, or None."""
        entries = self.by_pattern.get(_pattern(chosen.split("\n")), [])
        for tolerance in LENGTH_TOLERANCES:
            lo = bisect.bisect_left(entries, (int(len(chosen) * (1 - tolerance)),))
            hi = bisect.bisect_right(entries, (min(room, len(chosen) * (1 + tolerance)), "\uffff"))
            for _ in range(min(hi - lo, 16)):  # random tries, then a scan of the range
                _, text, other = entries[rng.randrange(lo, hi)]
                if other != play and text != chosen:
                    return text
            found = [text for _, text, other in entries[lo:hi] if other != play and text != chosen]
            if found:
                return rng.choice(found)
        return None


def _rejected(kind: str, prompt_last: str, c1: str, c2: str, play: str, room: int, pool: Pool,
              rng: random.Random) -> str | None:
    chosen = c1 + "\n" + c2
    if kind == "other_play":
        return pool.draw(chosen, play, room, rng)
    if kind == "shuffled":
        return c2 + "\n" + c1
    if kind == "repeated":
        options = [prompt_last + "\n" + c1, c1 + "\n" + c1]
        options = [o for o in options if o != chosen]
        return min(options, key=lambda o: abs(len(o) - len(chosen))) if options else None
    # truncated: c1, then c2 less its last one to a third of its words: the speech stops mid-sentence
    words = len(c2.split())
    if words < 4:
        return None
    return c1 + "\n" + c2.rsplit(None, rng.randint(1, words // 3))[0]


def candidates_of(play: str, parts: list[list[str]], pool: Pool, rng: random.Random) -> list[dict[str, dict]]:
    """Per speech, {kind: pair} for every kind it can give."""
    out = []
    for speech in parts:
        name, body = speech[0], speech[1:]
        found: dict[str, dict] = {}
        for k in (2, 1):
            lines = body[:k + 2]
            if len(lines) < k + 2 or not all(map(_usable, lines)):
                continue
            prompt = PROMPT + "\n".join([name] + lines[:k])
            c1, c2 = lines[k], lines[k + 1]
            chosen = c1 + "\n" + c2
            if (c1 == c2 or min(len(c1.split()), len(c2.split())) < MIN_LINE_WORDS or not _fits(prompt, chosen)
                    or not _shaped(c1, c2)):
                continue
            room = MAX_EXAMPLE_CHARS - len(prompt) - 1
            for kind in KINDS:
                if kind in found:
                    continue
                rejected = _rejected(kind, lines[k - 1], c1, c2, play, room, pool, rng)
                if rejected is not None and rejected != chosen and _fits(prompt, rejected):
                    found[kind] = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "kind": kind}
        if found:
            out.append(found)
    return out


def pairs_of(doc_id: str, play: str, parts: list[list[str]], pool: Pool, seed: int,
             made: dict[str, int]) -> list[dict]:
    """One pair of each kind the document can give, from different speeches spread evenly over it. When the
    speeches are too few for all kinds, the kinds with the fewest pairs so far (`made`, updated) go first."""
    rng = random.Random(f"{seed}\0{doc_id}")
    found = candidates_of(play, parts, pool, rng)
    order = list(KINDS)
    rng.shuffle(order)
    targets = _spread(list(range(len(found))), len(order))
    targets = dict(zip(order, targets + [len(found) // 2] * (len(order) - len(targets))))
    used, pairs = set(), []
    for kind in sorted(order, key=lambda kind: (made[kind], sum(kind in f for f in found))):
        target = targets[kind]
        near = sorted(range(len(found)), key=lambda i: (abs(i - target), i))
        pick = next((i for i in near if i not in used and kind in found[i]), None)
        if pick is not None:
            used.add(pick)
            pairs.append(found[pick][kind])
            made[kind] += 1
    return pairs


def main(argv) -> int:
    args = corpus_arguments(__doc__.splitlines()[0], argv)
    if args is None:
        return 2
    docs = {"train": [], "eval": []}
    pools = {name: Pool() for name in docs}
    for name, doc_id, play, text in play_documents(args):
        parts = speeches(text)
        docs[name].append((doc_id, play, parts))
        for speech in parts:
            pools[name].add(play, speech)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, found) in enumerate(docs.items()):
        pools[name].freeze()
        made = dict.fromkeys(KINDS, 0)
        rows = [r for doc_id, play, parts in found
                for r in pairs_of(doc_id, play, parts, pools[name], args.seed, made)]
        random.Random(args.seed + i).shuffle(rows)
        write_jsonl(out / f"{name}.jsonl", rows)
        print(f"{out / (name + '.jsonl')}: {len(rows)} pairs from {len(found)} documents")
        for kind in KINDS:
            of = [r for r in rows if r["kind"] == kind]
            if not of:
                continue
            chosen = sum(len(r["chosen"]) for r in of) / len(of)
            rejected = sum(len(r["rejected"]) for r in of) / len(of)
            matched = sum(abs(len(r["chosen"]) - len(r["rejected"])) <= 0.1 * len(r["chosen"]) for r in of)
            print(f"  {kind:<10} {len(of):5d} pairs, mean characters chosen {chosen:5.1f} rejected {rejected:5.1f},"
                  f" {matched} within 10% in length")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
