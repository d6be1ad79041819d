"""Hugging Face <-> jaxllm checkpoint conversion, generate/eval from checkpoints, perplexity and multiple choice."""

import gzip
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import sentencepiece as spm

from train_runs import train_command, train_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxllm.eval import evaluate  # noqa: E402
from jaxllm.parallel.mesh import single_device_mesh  # noqa: E402
from jaxllm.runs.loader import load_checkpoint  # noqa: E402
from jaxllm.data.pipeline import make_eval_batches  # noqa: E402
from jaxllm.data.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The `tiny` preset's shapes with the shakespeare store's vocabulary, so a run can start from the import.
HF_KWARGS = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, initializer_range=0.1)


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_KWARGS, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def imported(hf_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    assert _script("convert_hf").main(["import", "--hf", str(hf_model[1]), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.RandomState(0).randint(0, 512, (2, 12))


def test_export_round_trip_matches_transformers(hf_model, imported, ids, tmp_path):
    model, _ = hf_model
    assert _script("convert_hf").main(["export", "--checkpoint", str(imported), "--out", str(tmp_path)]) == 0
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    loaded = load_checkpoint(str(imported / "0"))  # a step directory works too
    ours = np.asarray(loaded.model(jnp.asarray(ids, jnp.int32)))
    theirs = _torch_logits(reloaded, ids)
    assert np.abs(ours - theirs).max() < 1e-4
    assert np.abs(theirs - _torch_logits(model, ids)).max() < 1e-4


def test_export_writes_the_run_tokenizer(hf_model, tmp_path, capsys):
    """The export's tokenizer gives the run's ids through AutoTokenizer and its config.json the run's special ids,
    so that generate stops at the run's EOS; a tokenizer that cannot be exported is a one-line error."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_model[1], hf_dir)
    with gzip.open(ROOT / "data" / "shakespeare.jsonl.gz", "rt") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(20), f)]
    tok = Tokenizer.train(docs, hf_dir / "tokenizer.model", vocab_size=512)  # the import records it with the run
    convert = _script("convert_hf")
    assert convert.main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "ckpt")]) == 0
    assert convert.main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in ("ROMEO. What say you to this?\n", "  two  spaces, é — 🙂\t12345", ""):
        assert ref.encode(text) == [tok.bos_id] + tok.encode(text)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = (tok.bos_id, tok.eos_id, tok.pad_id)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == ids == (2, 3, 0)
    generation = model.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == ids  # not Llama's eos 2
    # The recorded tokenizer replaced by one whose NFKC normaliser a tokenizer.json cannot reproduce exactly.
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(hf_dir / "tokenizer"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True,
                                   normalization_rule_name="nmt_nfkc", minloglevel=2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        convert.main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and "nmt_nfkc" in err and err.count("\n") == 1


def test_import_then_train_from_it(imported, shakespeare_store, tmp_path):
    workdir = tmp_path / "run"
    cmd = train_command(
        shakespeare_store, workdir, "--config.train.steps=2", "--config.train.eval_every=100",
        "--config.precision.compute=float32",
        "--config.anomaly.window=7",  # differs from the imported state's window: only params may be read
        f"--config.checkpoint.restore_from={imported}", "--config.checkpoint.every=2",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=train_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"starting from the parameters of {imported / '0'}" in proc.stdout
    summary = json.loads((workdir / "summary.json").read_text())
    # The run's initial held-out loss is the imported model's, not a fresh initialisation's.
    loaded = load_checkpoint(str(imported))
    mesh = single_device_mesh()
    batch_size = json.loads((workdir / "config.json").read_text())["train"]["batch_size"]
    expected = evaluate.perplexity(loaded.graphdef, loaded.params, mesh, shakespeare_store, seq_len=32,
                                   batch_size=batch_size, max_batches=1)["loss"]
    assert abs(summary["initial_eval_loss"] - expected) < 1e-3, (summary["initial_eval_loss"], expected)
    # The run's own checkpoint exports too (model config from its recorded run config).
    trained = load_checkpoint(str(workdir))
    assert trained.path.name == "2" and trained.tokenizer_path() == shakespeare_store / "tokenizer.model"


def test_generate_from_checkpoint_matches_hf(hf_model, imported, capsys):
    generate = _script("generate")
    common = ["--tokens", "1,5,9", "--max_new_tokens", "5"]
    assert generate.main(["--hf", str(hf_model[1])] + common) == 0
    from_hf = capsys.readouterr().out.strip()
    assert generate.main(["--checkpoint", str(imported)] + common) == 0
    assert capsys.readouterr().out.strip() == from_hf and len(from_hf.split(",")) == 5


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_perplexity_matches_independent_loop(imported, shakespeare_store, capsys):
    loaded = load_checkpoint(str(imported))
    mesh = single_device_mesh()
    got = evaluate.perplexity(loaded.graphdef, loaded.params, mesh, shakespeare_store, seq_len=32, batch_size=4,
                              max_batches=3)
    model, forward = loaded.model, nnx.jit(lambda m, *a: m(*a))
    total, count = 0.0, 0
    for batch in make_eval_batches(shakespeare_store, batch_size=4, seq_len=32, max_batches=3):
        with jax.set_mesh(mesh):
            logits = np.asarray(forward(model, jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"]),
                                        jnp.asarray(batch["positions"])))
        lp = np.take_along_axis(_log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
        mask = batch["loss_mask"].astype(bool)
        total -= lp[mask].sum()
        count += int(mask.sum())
    assert got["tokens"] == count > 0
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(total / count), rel=1e-5)
    eval_script = _script("eval")
    assert eval_script.main(["--checkpoint", str(imported), "--data", str(shakespeare_store), "--seq_len", "32",
                             "--batch_size", "4", "--max_batches", "3"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["tokens"] == count and printed["perplexity"] == pytest.approx(got["perplexity"], rel=1e-5)


QUESTIONS = [
    ("ROMEO. What say you", [" to this?", " my lord.", " xq zz.", " the king"]),
    ("KING. Good morrow", [", my lord.", " sweet queen.", " kk qq kk", " to all"]),
    ("First Citizen. Before we proceed", [" any further", " hear me speak.", " zzz", " and"]),
]


def _choice_scores(model, tokenizer, question, choices):
    """Independent scoring: one forward per choice of question+choice, summing log p of the choice's tokens."""
    context = [tokenizer.bos_id] + tokenizer.encode(question)
    forward = nnx.jit(lambda m, t: m(t))  # one compile: right padding to 32 never changes earlier (causal) logits
    scores = []
    for choice in choices:
        full = [tokenizer.bos_id] + tokenizer.encode(question + choice)
        assert full[:len(context)] == context
        logits = np.asarray(forward(model, jnp.asarray([full[:-1] + [0] * (32 - len(full) + 1)], jnp.int32)))[0]
        lp = _log_softmax(logits)
        scores.append(sum(lp[t - 1, full[t]] for t in range(len(context), len(full))))
    return np.asarray(scores)


def test_multiple_choice_accuracy(imported, shakespeare_store, tmp_path, capsys):
    loaded = load_checkpoint(str(imported))
    tokenizer = Tokenizer.load(shakespeare_store / "tokenizer.model")
    scores = [_choice_scores(loaded.model, tokenizer, q, c) for q, c in QUESTIONS]

    def write(name, answer_of):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"question": q, "choices": c, "answer": int(answer_of(s, c))}) + "\n"
                                for (q, c), s in zip(QUESTIONS, scores)))
        return str(path)

    best = write("best.jsonl", lambda s, c: np.argmax(s))
    worst = write("worst.jsonl", lambda s, c: np.argmin(s))
    best_char = write("best_char.jsonl", lambda s, c: np.argmax(s / np.asarray([len(x) for x in c])))
    mesh = single_device_mesh()
    assert _script("eval").main(["--checkpoint", str(imported), "--choices", best,
                                 "--tokenizer", str(shakespeare_store / "tokenizer.model")]) == 0
    results = {"best": json.loads(capsys.readouterr().out.strip().splitlines()[-1])}
    for name, path in (("worst", worst), ("best_char", best_char)):
        results[name] = evaluate.multiple_choice(loaded.graphdef, loaded.params, mesh, tokenizer,
                                                 evaluate.read_choices(path))
    assert results["best"]["mc_accuracy"] == 100.0 and results["best"]["mc_questions"] == 3  # percent, as named:
    assert "percent" in results["best"]["units"]
    assert results["worst"]["mc_accuracy"] == 0.0
    assert results["best_char"]["mc_accuracy_norm"] == 100.0
    # The batched, padded scorer agrees with the independent one.
    q, c = QUESTIONS[0]
    pairs = [evaluate.encode_choice(tokenizer, q, x) for x in c]
    got = evaluate.continuation_logprobs(loaded.graphdef, loaded.params, mesh, pairs)
    np.testing.assert_allclose(got, scores[0], rtol=1e-4, atol=1e-4)


def test_scripts_report_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _script("eval").main(["--checkpoint", str(tmp_path / "missing"), "--data", str(tmp_path)])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("error: ")
    with pytest.raises(SystemExit) as exc:
        _script("convert_hf").main(["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert exc.value.code == 2
