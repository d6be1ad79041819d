"""Model families beside Llama (jaxllm/config/families/: Qwen2, Qwen3, Mistral, Gemma 3): each against
transformers on a random tiny model built from its config (logits on plain and packed rows, one step's gradients,
greedy KV-cache decoding past the sliding windows), export to transformers and back bit for bit, PEFT adapters,
reward models, sharded loads, SFT's step across mesh layouts and a GRPO step, and the presets' sizes."""

import copy
import dataclasses
import functools
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxllm.config.families import FAMILIES  # noqa: E402
from jaxllm.config.cli import build_config, split_overrides  # noqa: E402
from jaxllm.config.fine_tuning import GRPOConfig  # noqa: E402
from jaxllm.config.schema import ConfigError, LoRAConfig, MeshConfig, PrecisionConfig, validate  # noqa: E402
from jaxllm.data.synthetic import synthetic_batch  # noqa: E402
from jaxllm.eval.evaluate import continuation_logprobs  # noqa: E402
from jaxllm.interop import hf  # noqa: E402
from jaxllm.model.build import build_model  # noqa: E402
from jaxllm.model.head import next_token_loss  # noqa: E402
from jaxllm.model.layers import windowed_attention, xla_attention  # noqa: E402
from jaxllm.model.visibility import attention_mask  # noqa: E402
from jaxllm.model.reward import RewardModel  # noqa: E402
from jaxllm.model.sample import generate  # noqa: E402
from jaxllm.objectives.grpo import grpo_loss_fn  # noqa: E402
from jaxllm.objectives.pretrain import lm_objective  # noqa: E402
from jaxllm.objectives.rollout import sequence_layout  # noqa: E402
from jaxllm.parallel.mesh import make_mesh, single_device_mesh  # noqa: E402
from jaxllm.model.transformer import total_params  # noqa: E402
from jaxllm.plan.footprint import GPUS, memory_plan  # noqa: E402
from jaxllm.runs.base_model import locate  # noqa: E402

from hf_models import saved_and_imported  # noqa: E402
from layout_steps import first_updates  # noqa: E402
from train_runs import ROOT  # noqa: E402

TOL = 1e-4
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=100, num_hidden_layers=2, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, initializer_range=0.1)
# name -> (transformers config class, its kwargs): grouped-query heads, Qwen3's head size apart from the width
# (4 x 16 = 64 over a width of 48), tied embeddings on Qwen2, and a Mistral window shorter than the inputs.
FAMILY_CONFIGS = {
    "qwen2": (transformers.Qwen2Config, dict(COMMON, num_attention_heads=6, num_key_value_heads=2,
                                             tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             tie_word_embeddings=False)),
    # a window of 4 divides the inputs' 12 and 16 positions: training takes the blocked windowed attention
    "mistral": (transformers.MistralConfig, dict(COMMON, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                                 sliding_window=4, tie_word_embeddings=False)),
    # a local (window 5, its own RoPE base) then a global layer, and a score scale apart from head_dim
    "gemma3": (transformers.Gemma3TextConfig, dict(
        COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 700.0}})),
}
NAMES = list(FAMILY_CONFIGS)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (torch model, its save_pretrained directory, the jaxllm import of it)."""
    return saved_and_imported(tmp_path_factory, FAMILY_CONFIGS)


@pytest.fixture(scope="module")
def ids():
    return np.random.RandomState(0).randint(0, 97, (2, 12))  # longer than the windows (Mistral 4, Gemma 3 5)


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_import_matches_transformers(saved, ids, name):
    model, _, jm = saved[name]
    assert jm.cfg.family == name
    err = np.abs(np.asarray(jm(jnp.asarray(ids, jnp.int32))) - torch_logits(model, ids)).max()
    assert err < TOL, err


@pytest.mark.parametrize("name", NAMES)
def test_packed_rows_match_each_document_alone(saved, ids, name):
    """Two documents packed in one row give each document's logits alone in transformers (the window counts
    within a document)."""
    model, _, jm = saved[name]
    a, b = ids[0, :7], ids[1, :9]
    tokens = np.concatenate([a, b])[None]
    segments = np.array([[1] * 7 + [2] * 9], np.int32)
    positions = np.array([list(range(7)) + list(range(9))], np.int32)
    packed = np.asarray(jm(jnp.asarray(tokens, jnp.int32), jnp.asarray(segments), jnp.asarray(positions)))[0]
    alone = np.concatenate([torch_logits(model, a[None])[0], torch_logits(model, b[None])[0]])
    assert np.abs(packed - alone).max() < TOL


def _jax_grads_in_hf_layout(jm, ids) -> tuple[float, dict]:
    """(mean next-token loss, {HF name: gradient}) of the jaxllm model on `ids`."""
    graphdef, params = nnx.split(jm)
    batch = {"tokens": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
             "segment_ids": jnp.ones(ids[:, 1:].shape, jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(ids.shape[1] - 1, dtype=jnp.int32), ids[:, 1:].shape)}

    def loss(p):
        total, count, _ = next_token_loss(nnx.merge(graphdef, p), dict(batch, loss_mask=jnp.ones_like(batch["tokens"])))
        return total / count

    value, grads = jax.value_and_grad(loss)(params)
    out = {}
    for row in hf.table(jm.cfg):
        if row.path == ("lm_head",) and jm.cfg.tie_embeddings:
            continue
        g = grads
        for key in row.path:
            g = g[key]
        g = np.asarray(g.get_value())
        for i in range(g.shape[0]) if row.stacked else [None]:
            out[row.hf.format(i=i)] = row.transform.to_hf(g if i is None else g[i])
    return float(value), out


@pytest.mark.parametrize("name", NAMES)
def test_one_step_gradients_match_torch_autograd(saved, ids, name):
    model, _, jm = saved[name]
    loss, grads = _jax_grads_in_hf_layout(jm, ids)
    model.zero_grad()
    torch_loss = model(torch.tensor(ids), labels=torch.tensor(ids)).loss
    torch_loss.backward()
    assert abs(loss - float(torch_loss.detach())) < TOL
    torch_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    assert set(grads) == set(torch_grads)
    for hf_name, g in grads.items():
        reference = torch_grads[hf_name]
        assert np.abs(g - reference).max() <= TOL * max(np.abs(reference).max(), 1e-6), hf_name


@pytest.mark.parametrize("name", NAMES)
def test_evaluation_scores_continuations_as_transformers(saved, name):
    """Evaluation on a family's model (the multiple-choice scoring of scripts/eval.py): each continuation's summed
    log-likelihood given its context equals transformers' (log-softmax of its logits), past the windows."""
    model, _, jm = saved[name]
    graphdef, params = nnx.split(jm)
    pairs = [([1, 5, 9], [3, 4]), ([2, 7, 11, 13, 17, 19, 23, 29], [31, 37, 41])]  # 11 > Mistral's 4, Gemma's 5
    ours = continuation_logprobs(graphdef, params, single_device_mesh(), pairs)
    theirs = []
    for context, continuation in pairs:
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([context + continuation])).logits[0].float(), -1).numpy()
        theirs.append(sum(logps[len(context) - 1 + i, token] for i, token in enumerate(continuation)))
    np.testing.assert_allclose(ours, theirs, atol=TOL)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_matches_transformers_generate(saved, name):
    """Token for token, 14 new tokens after prompts of 4 and 6: well past Mistral's window of 5."""
    model, path, jm = saved[name]
    prompts = [[5, 17, 42, 8], [3, 9, 77, 21, 60, 11]]
    ours = generate(jm, prompts, max_new_tokens=14)
    for prompt, new in zip(prompts, ours):
        with torch.no_grad():
            # no end-of-sequence id on either side (ours has no stop ids): both decode 14 tokens, whatever they are
            out = model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert new == out[0, len(prompt):].tolist()
    if jm.cfg.sliding_window:  # the unrolled decode (per-layer caches, each layer's kind picked statically) too
        unrolled = hf.from_pretrained(path)
        unrolled.cfg = dataclasses.replace(unrolled.cfg, scan_layers=False)
        assert generate(unrolled, prompts, max_new_tokens=14) == ours


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers_and_round_trips_bit_for_bit(saved, ids, tmp_path, name):
    model, _, jm = saved[name]
    hf.save_pretrained(jm, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (FAMILIES[name].model_type, [FAMILIES[name].causal_lm])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    assert np.abs(torch_logits(reloaded, ids) - torch_logits(model, ids)).max() < TOL
    again = hf.from_pretrained(tmp_path)
    assert again.cfg == jm.cfg
    for a, b in zip(jax.tree.leaves(nnx.state(jm)), jax.tree.leaves(nnx.state(again)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unsupported_options_are_one_line_errors_naming_the_key(saved, tmp_path):
    config = json.loads((saved["qwen2"][1] / "config.json").read_text())
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        hf.config_from_hf(dict(config, use_sliding_window=True))
    with pytest.raises(ValueError, match="attention_bias=true"):
        hf.config_from_hf(dict(json.loads((saved["qwen3"][1] / "config.json").read_text()), attention_bias=True))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        hf.config_from_hf(dict(config, model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError, match="model.sliding_window: family 'qwen2' has no sliding-window"):
        dataclasses.replace(saved["qwen2"][2].cfg, sliding_window=4).check()


LAYOUTS = [(8, 1, 1, 1), (1, 2, 2, 2)]
SEQUENCE_PARALLEL = (2, 2, 2, 1)
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets="q_proj,k_proj,v_proj,o_proj,down_proj")


def _tiny(saved, name):
    return dataclasses.replace(saved[name][2].cfg, vocab_size=128)


@pytest.mark.parametrize("name", NAMES)
def test_sft_step_losses_agree_across_layouts(saved, name):
    """SFT's step (LoRA adapters on the family's projections, next-token loss over the masked targets of packed
    rows) on data 8, on fsdp x tensor x stage, and on data x fsdp x tensor with sequence parallelism, full remat
    and the loss taken 8 positions at a time: the same three losses (heads divide tensor=2)."""
    cfg = _tiny(saved, name)
    batch = synthetic_batch(3, 8, 16, 128)
    losses = {layout: first_updates(lambda pipeline: lm_objective(cfg, F32, pipeline, lora=LORA), layout, batch)
              for layout in LAYOUTS}
    options = dataclasses.replace(cfg, remat="full", loss_chunk=8)
    losses["sequence parallel, remat, chunked loss"] = first_updates(
        lambda pipeline: lm_objective(options, F32, pipeline, lora=LORA, sequence_parallel=True), SEQUENCE_PARALLEL,
        batch)
    reference = losses[LAYOUTS[0]]
    assert reference[2][0] < reference[0][0]  # the adapters did train
    for layout in list(losses)[1:]:
        np.testing.assert_allclose(losses[layout], reference, rtol=1e-5, err_msg=str(layout))


def _rollout_rows(vocab: int, rows: int = 8, prompt: int = 6, new: int = 6) -> dict[str, np.ndarray]:
    """Left-padded prompts and responses with log-probs near a uniform guess's, and group advantages."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (rows, prompt + new)).astype(np.int32)
    start = rng.integers(0, prompt - 1, rows).astype(np.int32)
    tokens[np.arange(prompt + new)[None, :] < start[:, None]] = 0
    mask = (np.arange(new)[None, :] < rng.integers(1, new + 1, rows)[:, None]).astype(np.float32)
    segment_ids, positions = (np.asarray(x) for x in sequence_layout(tokens, start))
    logps = np.full((rows, new), -np.log(vocab), np.float32) * mask
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "mask": mask,
            "old_logps": logps, "ref_logps": logps, "advantages": rng.normal(0, 1, (rows, 1)).astype(np.float32),
            "scores": rng.uniform(0, 1, (rows, 1)).astype(np.float32), "stopped": np.ones((rows, 1), np.float32)}


@pytest.mark.parametrize("name", NAMES)
def test_grpo_step_trains_each_family(saved, name):
    """GRPO's step (clipped surrogate and KL to the base, LoRA adapters) on rollout rows: its loss moves."""
    cfg = _tiny(saved, name)

    def objective(pipeline):
        policy = lm_objective(cfg, F32, pipeline, lora=LORA)
        return dataclasses.replace(policy, loss_fn=functools.partial(grpo_loss_fn, grpo=GRPOConfig()))

    losses = [loss for (loss,) in first_updates(objective, LAYOUTS[0], _rollout_rows(cfg.vocab_size))]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", NAMES)
def test_reward_model_is_the_family_sequence_classification_both_ways(saved, tmp_path, name):
    """A reward model of the family's shape exports as its *ForSequenceClassification: transformers scores a
    sequence as jaxllm's last position does, and the export imports back as a reward model."""
    cfg = saved[name][2].cfg
    model = build_model(cfg, F32, jax.random.key(0), model_class=RewardModel)
    model.score[...] = jax.random.normal(jax.random.key(1), model.score.shape)
    hf.save_pretrained(model, tmp_path, pad_token_id=0)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(ref).__name__ == FAMILIES[name].sequence_classification
    ids = [[5, 17, 42, 8, 3, 9, 77], [21, 60, 11, 4, 6, 7, 8]]  # 7 tokens: past Mistral's window of 5
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))[:, -1]
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits[:, 0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=TOL)
    assert isinstance(hf.from_pretrained(tmp_path), RewardModel)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_peft_adapters_travel_both_ways(saved, ids, tmp_path, name):
    """A PEFT LoRA adapter (every target, by its Hugging Face name) on the family's base: imported it gives
    PEFT's logits; exported adapter-only it loads in PEFT with the same logits."""
    peft = pytest.importorskip("peft")
    model, base_path, _ = saved[name]
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    torch.manual_seed(3)
    peft_model = peft.get_peft_model(copy.deepcopy(model), config).eval()
    with torch.no_grad():
        for param_name, p in peft_model.named_parameters():
            if "lora_B" in param_name:  # PEFT starts B at zero: make the adapters matter
                p.copy_(0.1 * torch.randn_like(p))
    peft_model.save_pretrained(tmp_path / "theirs")
    expected = torch_logits(peft_model, ids)
    assert np.abs(expected - torch_logits(model, ids)).max() > 1e-2
    ours = hf.from_pretrained(base_path, adapter=tmp_path / "theirs")
    assert np.abs(np.asarray(ours(jnp.asarray(ids, jnp.int32))) - expected).max() < TOL
    hf.save_pretrained(ours, tmp_path / "ours", adapter_only=True, base_model=str(base_path))
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "ours").eval()
    assert np.abs(torch_logits(reloaded, ids) - expected).max() < TOL


# The parameter counts Hugging Face reports for these models (embeddings included, tied ones once).
PUBLISHED = {"qwen2_5_1_5b": 1_543_714_304, "qwen2_5_7b": 7_615_616_512, "qwen3_0_6b": 596_049_920,
             "qwen3_8b": 8_190_735_360, "mistral_7b": 7_248_023_552, "gemma3_1b": 999_885_952}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_sizes_and_plan(preset):
    """Each family preset has its model's published parameter count, and the memory planner (`--dry_run`'s
    formula) plans it for a GPU."""
    overrides = [f"--config.model.preset={preset}", "--config.mesh.data=1", "--config.mesh.fsdp=8",
                 "--config.mesh.tensor=1", "--config.train.batch_size=8", "--config.train.seq_len=2048"]
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), split_overrides(overrides)[1]), 8)
    assert cfg.model.family == preset.split("_")[0] and cfg.precision.compute == "bfloat16"
    assert total_params(cfg.model) == PUBLISHED[preset]
    plan = memory_plan(cfg, compiled=False)
    # float32 parameters split 8 ways by fsdp (a few dims do not divide evenly: within 1%)
    assert plan["param_bytes_per_device"] == pytest.approx(4 * PUBLISHED[preset] / 8, rel=0.01)
    assert set(plan["fits"]) == set(GPUS)


def test_a_hugging_face_base_of_a_family_gives_its_architecture_to_a_fine_tuning_run(saved):
    """`checkpoint.restore_from` a family's directory: the run adopts the family and its window."""
    base = locate(str(saved["mistral"][1]))
    assert (base.architecture["family"], base.architecture["sliding_window"]) == ("mistral", 4)
    assert locate(str(saved["qwen3"][1])).architecture["family"] == "qwen3"


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_sharded_load_places_the_blocks_parameters(saved, name):
    """Loaded straight into a (2,2,2,1) mesh, each shard reading its slice: the q/k/v biases split their heads
    over `tensor`, and the arrays equal an unsharded load's."""
    _, path, plain = saved[name]
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    sharded = hf.from_pretrained(path, mesh=mesh)
    for a, b in zip(jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(nnx.state(sharded)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if name == "qwen2":
        assert sharded.layers.self_attn.k_bias[...].sharding.spec == P(None, "tensor", None)


def test_windowed_attention_by_blocks_equals_the_masked_dense_one():
    """The blocked sliding-window path (each block of queries against its own and the previous block's keys)
    gives the dense path's outputs and gradients on packed rows with padding."""
    rng = np.random.default_rng(0)
    B, T, N, K, H, W = 2, 24, 4, 2, 8, 6
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in [(B, T, N, H), (B, T, K, H),
                                                                              (B, T, K, H)])
    segments = np.ones((B, T), np.int32)
    segments[0, 10:], segments[1, 20:] = 2, 0
    mask = attention_mask(jnp.asarray(segments), W)
    dense = lambda q, k, v: xla_attention(q, k, v, mask, 0.3)
    blocked = lambda q, k, v: windowed_attention(q, k, v, mask, W, 0.3)
    np.testing.assert_allclose(blocked(q, k, v), dense(q, k, v), atol=1e-6)
    loss = lambda f: lambda *x: jnp.sum(f(*x) ** 2)
    for a, b in zip(jax.grad(loss(blocked), (0, 1, 2))(q, k, v), jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-5)
