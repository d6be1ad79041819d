"""Task metrics as reported after SFT and by scripts/eval.py --task: exact match in percent, corpus BLEU only
where the references are free text, and the base-vs-tuned table's n/a for what a side does not have."""

import pytest

from jaxllm.eval.task_eval import score
from jaxllm.train.fit import format_task_table

sacrebleu = pytest.importorskip("sacrebleu")

EXAMPLES = [{"task": "label", "reference": "verse"}, {"task": "label", "reference": "prose"},
            {"task": "line", "reference": "to be or not to be that is the question"},
            {"task": "line", "reference": "the quality of mercy is not strained"}]
RESPONSES = ["verse", "verse", "to be or not to be that is the question", "the quality of mercy is strained"]


def test_bleu_is_given_for_free_text_only():
    scores = score(RESPONSES, EXAMPLES)
    assert scores["label"] == {"examples": 2, "exact_match": 50.0, "bleu": None}  # one-word answers: no 4-grams
    lines = [e["reference"] for e in EXAMPLES[2:]]
    assert scores["line"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(RESPONSES[2:], [lines]).score)
    assert 0 < scores["line"]["bleu"] < 100 and scores["line"]["exact_match"] == 50.0
    assert scores["all"]["examples"] == 4 and scores["all"]["exact_match"] == 50.0


def test_the_table_shows_what_a_side_lacks_as_n_a():
    tuned = {"all": {"examples": 4, "reward_accuracy": 75.0, "bleu": None}}
    table = format_task_table({"all": {"examples": 4}}, tuned)
    assert table.splitlines()[1].split() == ["all", "4", "n/a", "75.0%", "n/a", "n/a"], table
