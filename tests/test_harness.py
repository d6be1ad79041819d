"""The lm-evaluation-harness backend (jaxllm/eval/harness.py) against the harness's own `hf` backend on the same
model exported with scripts/convert_hf.py: a random Llama with the shipped corpus's sentencepiece tokenizer and a
random Qwen3 with a byte-level tokenizer.json (no BOS token), through the offline task pack (eval_tasks/): every
request's log-likelihood, is_greedy, generation and task metric. Then batching, the checkpoint kinds, one-line
errors and the in-training callback."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from hf_models import random_causal_lm  # noqa: E402
from jaxllm.data import sft_template  # noqa: E402
from jaxllm.eval import harness  # noqa: E402
from jaxllm.model.sample import generate  # noqa: E402
from jaxllm.observe.tensorboard import read_scalars  # noqa: E402
from train_runs import ROOT, train_env  # noqa: E402

MAX_LENGTH = 128
LIMIT = 4  # documents per task of the pack
TASKS = ["jaxllm_pack"]  # its six tasks: perplexity, multiple choice, cloze and the SFT task's three generations
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1)


def _convert(*args):
    """scripts/convert_hf.py in this process (a subprocess would import jax again for each conversion)."""
    spec = importlib.util.spec_from_file_location("_convert_hf", ROOT / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(list(args)) == 0


def _byte_level_tokenizer(directory: Path) -> None:
    """A GPT-2-style tokenizer.json (no BOS token: jaxllm's documents then start with its EOS) of 512 ids."""
    import gzip

    with gzip.open(ROOT / "data" / "shakespeare.jsonl.gz", "rt") as f:
        texts = [json.loads(line)["text"][:4000] for line, _ in zip(f, range(40))]
    tk = __import__("tokenizers").Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))


@pytest.fixture(scope="module")
def families(shakespeare_store, tmp_path_factory):
    """family -> (jaxllm checkpoint imported from a random HF model, that checkpoint exported back)."""
    out = {}
    configs = {"llama": transformers.LlamaConfig(vocab_size=512, **SHAPE),
               "qwen3": transformers.Qwen3Config(vocab_size=512, **SHAPE)}
    for seed, (name, config) in enumerate(configs.items()):
        root = tmp_path_factory.mktemp(name)
        random_causal_lm(config, seed).save_pretrained(root / "hf")
        if name == "llama":
            (root / "hf" / "tokenizer.model").write_bytes((shakespeare_store / "tokenizer.model").read_bytes())
        else:
            _byte_level_tokenizer(root / "hf")
        _convert("import", "--hf", str(root / "hf"), "--out", str(root / "ckpt"))
        _convert("export", "--checkpoint", str(root / "ckpt"), "--out", str(root / "export"))
        out[name] = (root / "ckpt", root / "export")
    return out


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(ROOT / "eval_tasks"), include_defaults=False)


def _evaluate(model, task_manager):
    return lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=task_manager, limit=LIMIT,
                                   log_samples=True, bootstrap_iters=0, verbosity="WARNING")


def _reference(export):
    return HFLM(pretrained=str(export), max_length=MAX_LENGTH, batch_size=4, dtype="float32", device="cpu")


def _responses(out) -> dict:
    """(task, doc id) -> the model's raw responses of that document (a list per request)."""
    return {(task, s["doc_id"]): s["resps"] for task, samples in out["samples"].items() for s in samples}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_parity_with_the_hf_backend(families, task_manager, family):
    checkpoint, export = families[family]
    ours_lm = harness.JaxLLM(checkpoint=str(checkpoint), max_length=MAX_LENGTH, batch_size=4)
    theirs_lm = _reference(export)
    ours, theirs = _evaluate(ours_lm, task_manager), _evaluate(theirs_lm, task_manager)
    mine, reference = _responses(ours), _responses(theirs)
    assert mine.keys() == reference.keys() and len(mine) == LIMIT * 6
    greedy, undecodable = [], []
    for key, responses in reference.items():
        for got, want in zip(mine[key], responses, strict=True):
            got, want = got[0], want[0]
            if isinstance(want, str):  # a generation: greedy decoding gives the same text
                if got != want:  # see _same_tokens
                    assert "\ufffd" in want, (key, got, want)
                    undecodable.append(key)
                greedy.append((key, want))
            elif isinstance(want, tuple):  # (log-likelihood, is_greedy)
                assert abs(got[0] - want[0]) < 1e-4, (key, got, want)
                assert got[1] == want[1], key
            else:  # a rolling log-likelihood: a document's windows summed; float32 sums of ~1e4 round at ~1e-3
                assert abs(got - want) < 1e-4 + 1e-7 * abs(want), (key, got, want)
    assert ours["results"].keys() == theirs["results"].keys()
    for task, metrics in theirs["results"].items():
        for name, value in metrics.items():  # rates exactly, perplexities to their log-likelihoods' precision
            exact = not isinstance(value, float) or "perplexity" not in name and "bits" not in name
            assert ours["results"][task][name] == (value if exact else pytest.approx(value, rel=1e-4)), (task, name)
    for key in undecodable:
        _same_tokens(ours_lm, theirs_lm, _context(ours, key))
    # The model's own greedy continuations of short contexts: is_greedy on both sides (the task data's never are).
    contexts = [json.loads(line)["context"][-60:] for line in
                (ROOT / "eval_tasks" / "data" / "shakespeare_cloze.jsonl").read_text().splitlines()[:32]]
    made = ours_lm.generate_until([Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": 3}), n)
                                   for n, c in enumerate(contexts)])
    requests = [Instance("loglikelihood", {}, (c, text), n) for n, (c, text) in enumerate(zip(contexts, made))
                if text.strip() and "\ufffd" not in text]
    got, want = ours_lm.loglikelihood(requests), theirs_lm.loglikelihood(requests)
    assert [g[1] for g in got] == [w[1] for w in want] and sum(w[1] for w in want) >= len(contexts) // 4
    assert np.allclose([g[0] for g in got], [w[0] for w in want], atol=1e-4)


def _same_tokens(ours, theirs, context: str, max_new: int = 32) -> None:
    """The same greedy tokens from both backends' models for `context`, where the texts differ only in decoding: a
    random model emits runs of byte tokens that are not valid UTF-8, which transformers' ByteFallback decoder
    turns into U+FFFD whole while sentencepiece (the run's own tokenizer) keeps the bytes that are characters.
    Ours stops at a stop string's token; transformers' model runs on to max_new, so ours is a prefix of it."""
    prompt = ours.tok_encode(context, left_truncate_len=MAX_LENGTH - max_new)
    reference = theirs.model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    with jax.set_mesh(ours.model.mesh):
        tokens = generate((ours.model.graphdef, ours.model.params), [prompt], max_new_tokens=max_new,
                          stop_ids=ours._stop_ids(["\n", "###"]), vocab_limit=ours.tokenizer.vocab_size,
                          keep_stop=True)[0]
    assert tokens == reference[0, len(prompt):len(prompt) + len(tokens)].tolist()


def _context(out, key) -> str:
    task, doc = key
    sample = next(s for s in out["samples"][task] if s["doc_id"] == doc)
    return sample["arguments"][0][0]


def _pack_requests(n: int = 24) -> list:
    """Multiple-choice and cloze requests of the pack's data, and two whole documents to roll over."""
    data = ROOT / "eval_tasks" / "data"
    mc = [json.loads(x) for x in (data / "shakespeare_mc.jsonl").read_text().splitlines()[:n // 4]]
    cloze = [json.loads(x) for x in (data / "shakespeare_cloze.jsonl").read_text().splitlines()[:n // 2]]
    pairs = [(d["context"], " " + d["word"]) for d in cloze] + [("", d["context"]) for d in cloze[:2]]
    pairs += [(doc["context"], "\n" + choice) for doc in mc for choice in doc["choices"]]
    docs = [json.loads(x)["text"] for x in (data / "shakespeare_ppl.jsonl").read_text().splitlines()[:2]]
    return ([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
            [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(docs)])


def test_batch_size_changes_no_result(families):
    """Packing and batching: 1, 4 and 16 rows a forward pass (on one device, so the sizes are what runs) give every
    request the same values."""
    scored, rolled = _pack_requests()
    assert len(scored) >= 20
    results = []
    for rows in (1, 4, 16):
        lm = harness.JaxLLM(checkpoint=str(families["llama"][0]), max_length=MAX_LENGTH, batch_size=rows, data=1)
        assert lm.rows == rows
        results.append((lm.loglikelihood(scored), lm.loglikelihood_rolling(rolled)))
    for other in results[1:]:
        assert other == results[0]
    # Packed with others or alone in its row, a request's values are the same.
    alone = [lm.loglikelihood([request])[0] for request in scored[::7]]
    assert alone == results[0][0][::7]
    # The exported Hugging Face directory as the checkpoint: the same model.
    exported = harness.JaxLLM(checkpoint=str(families["llama"][1]), max_length=MAX_LENGTH, data=1)
    again = exported.loglikelihood(scored[::7])
    assert np.allclose([a[0] for a in again], [a[0] for a in alone], atol=1e-5)
    assert [a[1] for a in again] == [a[1] for a in alone]


def test_sampled_generation(families):
    """A task that samples draws from the model (temperature, top-k, top-p): the same seed gives the same texts,
    another seed others; generation kwargs the sampler does not have are refused."""
    contexts = [json.loads(x)["context"] for x in
                (ROOT / "eval_tasks" / "data" / "shakespeare_cloze.jsonl").read_text().splitlines()[:8]]
    kwargs = {"until": [], "max_gen_toks": 6, "do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 0.95}
    requests = [Instance("generate_until", {}, (c, kwargs), n) for n, c in enumerate(contexts)]
    model = lambda seed: harness.JaxLLM(checkpoint=str(families["llama"][0]), max_length=MAX_LENGTH, seed=seed,
                                        data=1)
    first = model(1)
    drawn = first.generate_until(requests)
    assert model(1).generate_until(requests) == drawn != model(2).generate_until(requests)
    greedy = first.generate_until([Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": 6}), n)
                                   for n, c in enumerate(contexts)])
    assert greedy != drawn
    with pytest.raises(ValueError, match="not supported"):
        beams = {"until": [], "max_gen_toks": 4, "num_beams": 4}
        first.generate_until([Instance("generate_until", {}, (contexts[0], beams), 0)])


def test_checkpoint_kinds(bases, lora_run, shakespeare_store, tmp_path):
    """A pretraining run and a LoRA SFT run (adapters on their recorded base) load with the run's tokenizer and
    length; the LoRA run scores as the harness's hf backend scores its merged export."""
    scored, _ = _pack_requests(8)
    base = harness.JaxLLM(checkpoint=str(bases[0]), batch_size=8)
    assert base.max_length == 32 and base.tokenizer.model_proto == \
        (shakespeare_store / "tokenizer.model").read_bytes()
    tuned = harness.JaxLLM(checkpoint=str(lora_run), batch_size=8)
    assert tuned.max_length == 128 and tuned.model.template == "alpaca"
    _convert("export", "--checkpoint", str(lora_run), "--out", str(tmp_path / "merged"))
    reference = HFLM(pretrained=str(tmp_path / "merged"), max_length=128, batch_size=8, dtype="float32",
                     device="cpu")
    got, want, before = (lm.loglikelihood(scored) for lm in (tuned, reference, base))
    assert np.allclose([g[0] for g in got], [w[0] for w in want], atol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert not np.allclose([g[0] for g in got], [b[0] for b in before], atol=1e-3)
    # --apply_chat_template renders as the SFT run trained: its prompt's ids are the training row's prompt ids.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is this verse?\nTo be."}]
    text = tuned.apply_chat_template(messages)
    pieces = sft_template.prompt_pieces(sft_template.render("alpaca", messages + [
        {"role": "assistant", "content": "verse"}], tuned.tokenizer))
    assert tuned.tok_encode(text) == sft_template.encode(pieces, tuned.tokenizer)[0]
    assert tuned.chat_template(True) == "alpaca" and tuned.chat_template(False) is None


def test_bad_model_args_are_one_line_errors(bases, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxllm.eval.harness", "--model", "jaxllm", "--model_args",
                           f"checkpoint={bases[0]},bogus=1", "--tasks", "jaxllm_shakespeare_cloze",
                           "--include_path", str(ROOT / "eval_tasks")], capture_output=True, text=True,
                          env=train_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model_args: unknown key 'bogus'")
    assert "Traceback" not in proc.stderr
    for args, message in ((dict(checkpoint=str(tmp_path / "nothing")), "no such checkpoint directory"),
                          (dict(checkpoint=str(bases[0]), batch_size="0"), "batch_size=0 must be at least 1"),
                          (dict(checkpoint=str(bases[0]), data=16), "at most the 8 there are"),
                          (dict(checkpoint=str(bases[0]), max_length="long"), "max_length='long' is not an integer"),
                          (dict(checkpoint=str(bases[0]), dtype="float8"), "dtype='float8' \\(expected one of"),
                          (dict(checkpoint=str(bases[0]), template="vicuna"), "template='vicuna'"),
                          (dict(), "checkpoint=<run, checkpoint or Hugging Face directory> is required")):
        with pytest.raises(harness.HarnessArgumentError, match=message) as error:
            harness.JaxLLM(**args)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="no such directory"):  # eval.harness_include_path, checked at start-up
        harness.checked_tasks(["jaxllm_pack"], str(tmp_path / "nothing"))


def test_in_training_callback_writes_task_metrics(bases):
    """The first base ran one pack task after each of its 2 steps (tests/train_runs.py HARNESS): its metrics at
    steps 1 and 2 in metrics.jsonl and TensorBoard, step 2's those of the step-2 checkpoint; the other base none."""
    names = ("harness/jaxllm_shakespeare_cloze/acc", "harness/jaxllm_shakespeare_cloze/perplexity")
    records = [json.loads(x) for x in (bases[0] / "metrics.jsonl").read_text().splitlines()]
    tasks = {r["step"]: {k: r[k] for k in names} for r in records if names[0] in r}
    assert sorted(tasks) == [1, 2] and all(v.keys() == set(names) for v in tasks.values())
    assert tasks[1][names[1]] != tasks[2][names[1]]  # a different model each time
    scalars = read_scalars(bases[0] / "tb")
    assert [step for step, _ in scalars[names[1]]] == [1, 2]
    assert not any(names[0] in x for x in (bases[1] / "metrics.jsonl").read_text().splitlines())
    loaded = harness.load(str(bases[0]), 2, harness.mesh_arg(None, 1, 1))
    again = harness.evaluate_tasks(loaded, ["jaxllm_shakespeare_cloze"], include_path=str(ROOT / "eval_tasks"),
                                   limit=4)
    assert again == pytest.approx(tasks[2], rel=1e-6)
