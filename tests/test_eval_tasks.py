"""The offline lm-evaluation-harness task pack eval_tasks/ (scripts/make_eval_tasks.py, eval_tasks/README.md): its
data files are what the script makes from the shipped corpus, byte for byte; lm_eval indexes its tasks and groups
and loads each task's docs from those files with no network, prompted as the tasks say; its passages are held out
(none of the perplexity, MC and cloze tasks' passages is in make train's train split, none of the MC and cloze
tasks' lines in make sft's train.jsonl, and the SFT tasks' examples are make sft's eval examples); and `make eval`
checks its model before it installs anything, then installs the eval extra and runs the pack (`make -n`)"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tasks read local files; never reach the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_eval_tasks  # noqa: E402
import make_sft_task  # noqa: E402
from jaxllm.data.sft_template import prompt_pieces, render  # noqa: E402

CORPUS = str(ROOT / "data" / "shakespeare.jsonl.gz")
PACK = ROOT / "eval_tasks"
# task: (data file, docs, fields)
TASKS = {
    "jaxllm_shakespeare_ppl": ("shakespeare_ppl.jsonl", 24, {"doc", "text"}),
    "jaxllm_shakespeare_mc": ("shakespeare_mc.jsonl", 145, {"doc", "context", "choices", "label"}),
    "jaxllm_shakespeare_cloze": ("shakespeare_cloze.jsonl", 118, {"doc", "context", "word"}),
    "jaxllm_sft_form": ("sft_form.jsonl", 154, {"prompt", "response", "task"}),
    "jaxllm_sft_title": ("sft_title.jsonl", 125, {"prompt", "response", "task"}),
    "jaxllm_sft_next_line": ("sft_next_line.jsonl", 125, {"prompt", "response", "task"}),
}
GROUPS = {"jaxllm_pack": ["jaxllm_shakespeare_ppl", "jaxllm_shakespeare_mc", "jaxllm_shakespeare_cloze",
                          "jaxllm_sft_generate"],
          "jaxllm_sft_generate": ["jaxllm_sft_form", "jaxllm_sft_title", "jaxllm_sft_next_line"]}


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (PACK / "data" / name).read_text().splitlines()]


def test_the_data_files_are_what_the_script_makes_from_the_corpus(tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        assert make_eval_tasks.main(["--corpus", CORPUS, "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in (PACK / "data").iterdir()) == sorted(make_eval_tasks.FILES)
    for name in make_eval_tasks.FILES:
        assert (tmp_path / name).read_bytes() == (PACK / "data" / name).read_bytes(), (
            f"eval_tasks/data/{name} is stale: run python scripts/make_eval_tasks.py")


@pytest.fixture(scope="module")
def loaded():
    """lm_eval's TaskManager over eval_tasks/ alone (not its ~10,000 built-in tasks) and the loaded pack, from the
    repository root, where the tasks' data_files paths point. (The test extra has lm-eval below Python 3.12 only.)"""
    TaskManager = pytest.importorskip("lm_eval.tasks").TaskManager

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        manager = TaskManager(include_path=str(PACK), include_defaults=False)
        return manager, manager.load("jaxllm_pack")
    finally:
        os.chdir(cwd)


def test_lm_eval_indexes_the_pack_and_loads_every_task_offline(loaded):
    manager, pack = loaded
    assert sorted(manager.all_subtasks) == sorted(TASKS)
    assert sorted(manager.all_groups) == sorted(GROUPS)
    assert pack["group_map"] == GROUPS
    assert sorted(pack["tasks"]) == sorted(TASKS)
    for name, (file, count, fields) in TASKS.items():
        task = pack["tasks"][name]
        docs = list(task.test_docs())
        assert len(docs) == count == len(_rows(file)), name
        assert all(set(doc) == fields for doc in docs), name
        assert docs == _rows(file), name


def test_each_task_prompts_and_targets_as_meant(loaded):
    tasks = loaded[1]["tasks"]
    ppl = tasks["jaxllm_shakespeare_ppl"]
    for doc in ppl.test_docs():
        assert ppl.doc_to_target(doc) == doc["text"] and 0 < len(doc["text"]) <= make_eval_tasks.PPL_MAX_CHARS
    mc = tasks["jaxllm_shakespeare_mc"]
    assert mc.config.target_delimiter == "\n"
    for doc in mc.test_docs():
        choices = mc.doc_to_choice(doc)
        assert mc.doc_to_text(doc) == doc["context"] and len(set(choices)) == 4
        assert mc.doc_to_target(doc) in range(4)
    cloze = tasks["jaxllm_shakespeare_cloze"]
    for doc in cloze.test_docs():
        assert cloze.doc_to_text(doc) == doc["context"] and cloze.doc_to_target(doc) == " " + doc["word"]
        assert doc["word"].isalpha() and not doc["context"].endswith((" ", "\n"))
    # the SFT prompt: what the trainer's "alpaca" template feeds the model before the response, less its BOS token
    tokenizer = types.SimpleNamespace(bos_id=1, eos_id=2)
    for name in ("jaxllm_sft_form", "jaxllm_sft_title", "jaxllm_sft_next_line"):
        task = tasks[name]
        assert task.config.generation_kwargs["until"] == ["\n", "###"]
        for doc in task.test_docs():
            messages = [{"role": "user", "content": doc["prompt"]}, {"role": "assistant", "content": doc["response"]}]
            pieces = prompt_pieces(render("alpaca", messages, tokenizer))
            assert pieces[0].token == tokenizer.bos_id
            assert task.doc_to_text(doc) == "".join(p.text for p in pieces[1:])
            assert task.doc_to_target(doc) == doc["response"]
        # exact match: surrounding whitespace aside, case and all
        doc = next(iter(task.test_docs()))
        assert task.process_results(doc, [f" {doc['response']}  "])["exact_match"] == 1
        assert task.process_results(doc, [doc["response"].upper()])["exact_match"] == 0


def test_no_passage_is_in_what_make_train_and_make_sft_train_on(tmp_path):
    split = make_eval_tasks.pretrain_split(CORPUS)
    assert sum(s == "eval" for s, _ in split.values()) == 24 and len(split) == 1303  # data/README.md
    train_text = "\0".join(text for s, text in split.values() if s == "train")
    passages = {
        "shakespeare_ppl.jsonl": lambda r: [r["text"]],
        "shakespeare_mc.jsonl": lambda r: [r["context"] + "\n" + choice for choice in r["choices"]],
        "shakespeare_cloze.jsonl": lambda r: [r["context"] + " " + r["word"]],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        assert make_sft_task.main(["--corpus", CORPUS, "--out", str(tmp_path)]) == 0
    sft = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
           for name in ("train", "eval")}
    sft_train_lines = {line for e in sft["train"] for line in make_eval_tasks.example_lines(e)}
    for name, of in passages.items():
        for row in _rows(name):
            assert split[row["doc"]][0] == "eval", (name, row["doc"])
            assert not any(p in train_text for p in of(row)), (name, row)
            if name != "shakespeare_ppl.jsonl":  # a whole scene holds the passages of make sft's examples of it
                lines = [line for p in of(row) for line in p.split("\n")[1:]]  # less the speaker's name
                assert not sft_train_lines.intersection(lines), (name, row)
    for kind in make_sft_task.PER_DOCUMENT:
        assert _rows(f"sft_{kind}.jsonl") == [e for e in sft["eval"] if e["task"] == kind]
    assert not {e["prompt"] for e in sft["train"]} & {e["prompt"] for e in sft["eval"]}


def _make(directory: Path, *args: str):
    return subprocess.run(["make", "--no-print-directory", *args, f"VENV={directory / 'venv'}"], cwd=directory,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def bare(tmp_path):
    """The Makefile and pyproject.toml of a checkout, with no venv and no runs."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("run", [None, "runs/sft_lora"])
def test_make_eval_refuses_without_its_model_before_installing_anything(bare, run):
    proc = _make(bare, "eval", "PYTHON=false", *([f"EVAL_RUN={run}"] if run else []))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (f"error: make eval evaluates EVAL_RUN={run or 'runs/pretrain'}, which is "
                                           "missing (by default the model of make train: run make train first)")
    assert sorted(p.name for p in bare.iterdir()) == ["Makefile", "pyproject.toml"]


def test_make_eval_installs_the_eval_extra_and_runs_the_pack_on_its_run(bare):
    (bare / "runs" / "pretrain" / "checkpoints").mkdir(parents=True)
    (bare / "hf_model").mkdir()
    for run, args in (("runs/pretrain", []), ("hf_model", ["EVAL_RUN=hf_model", "ARGS=--limit 8"])):
        proc = _make(bare, "-n", "eval", *args)
        assert proc.returncode == 0, proc.stderr
        assert "pip install -q -e '.[eval]'" in proc.stdout
        command = " ".join(proc.stdout.replace("\\\n", " ").split())  # one line, continuations joined
        assert (f"HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 {bare / 'venv'}/bin/python -m jaxllm.eval.harness "
                f"--model jaxllm --model_args checkpoint={run} --include_path eval_tasks --tasks jaxllm_pack"
                f"{' --limit 8' * bool(args)}") in command, proc.stdout
