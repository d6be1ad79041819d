"""Preference pairs, the reward model and DPO in process: data preparation and its one-line errors, pairs in one
row, rewards equal to transformers' LlamaForSequenceClassification on the same weights (export and import),
packed log-probabilities equal to unpacked ones, the LoRA reference is the base itself, the edge cases the
formulas predict, and both objectives agree across mesh layouts."""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.interop import hf
from jaxllm.config.fine_tuning import DPOConfig
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, OptimConfig, PipelineConfig, PrecisionConfig
from jaxllm.data.preference import encode_pairs, pack_pairs, prepare_preference, read_pairs
from jaxllm.data.row_prep import PreparedDataError, PreparedRows
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.model.lora import adapters_of
from jaxllm.parallel.mesh import make_mesh
from jaxllm.model.reward import RewardModel
from jaxllm.optim.chain import make_optimizer
from jaxllm.model.reference import reference_model
from jaxllm.objectives.dpo import dpo_loss_fn, sequence_logps
from jaxllm.parallel.host_rows import to_global
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.objectives.reward import pair_rewards, reward_loss, reward_model_objective
from jaxllm.train.state import init_objective_state
from jaxllm.model.build import build_model
from jaxllm.train.step import batch_sharding, grads_and_loss, jit_train_step, make_train_step

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets="q_proj,v_proj,o_proj,down_proj")
K = 2  # pairs per row
SEQ = 64


def _random_pairs(seed: int, count: int):
    """Pairs of token sequences sharing a prompt: ((chosen ids, mask), (rejected ids, mask))."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(count):
        prompt = [2] + list(rng.integers(4, MODEL.vocab_size, rng.integers(3, 8)))
        sides = []
        for _ in range(2):
            response = list(rng.integers(4, MODEL.vocab_size, rng.integers(2, 9))) + [3]
            sides.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
        pairs.append(tuple(sides))
    return pairs


def _rows(seed=0, count=12):
    rows, where = pack_pairs(_random_pairs(seed, count), SEQ, seed, K)
    return rows, where


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------------------- data


def test_pairs_are_tokenised_with_a_shared_prompt_and_response_only_masks(shakespeare_store, tmp_path):
    tok = load_tokenizer(shakespeare_store / "tokenizer.model")
    records = [{"prompt": "ROMEO.\nBut soft,", "chosen": "what light through yonder window breaks?",
                "rejected": "what light?", "kind": "truncated"},
               {"prompt": [{"role": "system", "content": "Be Juliet."}, {"role": "user", "content": "Speak."}],
                "chosen": [{"role": "assistant", "content": "O Romeo, Romeo!"}], "rejected": "Good night.",
                "kind": "chat"}]
    train = _write(tmp_path / "train.jsonl", records * 3)
    manifest = prepare_preference(tmp_path / "prepared", train_file=train, eval_file="",
                                  tokenizer_path=shakespeare_store / "tokenizer.model", template="alpaca",
                                  seq_len=128, overlong="truncate", eval_fraction=0.3, seed=0, pairs_per_row=2,
                                  log=lambda *_: None)
    assert manifest["splits"]["train"]["pairs"] + manifest["splits"]["eval"]["pairs"] == 6
    rows = PreparedRows(tmp_path / "prepared", "train", shuffle=False).get_rows(np.arange(3))
    seen = set()
    for r in range(len(rows["tokens"])):
        seg = rows["segment_ids"][r]
        for slot in range(2):
            chosen, rejected = seg == 2 * slot + 1, seg == 2 * slot + 2
            if not chosen.any():
                continue
            assert rejected.any()  # a pair's two sequences share its row
            c_ids, r_ids = rows["tokens"][r][chosen], rows["tokens"][r][rejected]
            c_mask, r_mask = rows["loss_mask"][r][chosen], rows["loss_mask"][r][rejected]
            prompt = np.argmax(c_mask)  # the target of position `prompt` is the first response token
            assert np.array_equal(c_ids[:prompt + 1], r_ids[:prompt + 1]) and np.argmax(r_mask) == prompt
            assert c_mask[-1] == 0 and not c_mask[:prompt].any()  # the last position has no target
            response = tok.decode(rows["targets"][r][chosen][c_mask == 1])
            seen.add(response)
            assert np.array_equal(rows["positions"][r][chosen], np.arange(chosen.sum()))
    assert seen <= {"what light through yonder window breaks?", "O Romeo, Romeo!"} and seen


def test_bad_records_are_counted_and_skipped_with_their_lines(tmp_path):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    path = _write(tmp_path / "pairs.jsonl", [good, "{not json", {"prompt": "p", "chosen": "a"},
                                             {"prompt": "p", "chosen": "same", "rejected": "same"},
                                             {"prompt": "p", "chosen": 3, "rejected": "b"},
                                             {**good, "kind": 7},
                                             {"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a",
                                              "rejected": "b"}])
    skipped = []
    assert len(list(read_pairs(path, skipped))) == 1
    assert [(s["line"], s["reason"]) for s in skipped] == [
        (2, "not valid JSON"), (3, "missing field 'rejected'"), (4, "chosen and rejected are the same"),
        (5, "field 'chosen' must be a string or a non-empty list of messages"), (6, "field 'kind' must be a string"),
        (7, "the prompt must not end with an assistant message")]


def test_overlong_pairs_are_truncated_or_dropped(shakespeare_store):
    tok = load_tokenizer(shakespeare_store / "tokenizer.model")
    long = " ".join(["speak"] * 80)
    records = [([{"role": "user", "content": "p"}], long, long + " more", "k"),
               ([{"role": "user", "content": "p"}], "yes", "no", "k")]
    kept = encode_pairs(records, tok, "alpaca", 64, "truncate")
    assert (kept.truncated, len(kept.pairs), kept.dropped) == (0, 1, {"identical_after_truncation": 1})
    records[0] = ([{"role": "user", "content": "p"}], long, "no", "k")
    kept = encode_pairs(records, tok, "alpaca", 64, "truncate")
    assert kept.truncated == 1 and all(len(ids) <= 32 for pair in kept.pairs for ids, _ in pair)
    assert encode_pairs(records, tok, "alpaca", 64, "drop").dropped == {"too_long": 1}


def test_preparing_into_a_directory_of_other_data_is_refused(shakespeare_store, tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"prompt": "p", "chosen": f"a{i}", "rejected": "b"} for i in range(4)])
    kwargs = dict(train_file=train, eval_file="", tokenizer_path=shakespeare_store / "tokenizer.model",
                  template="alpaca", seq_len=64, overlong="truncate", eval_fraction=0.5, seed=0, pairs_per_row=2,
                  log=lambda *_: None)
    prepare_preference(tmp_path / "prepared", **kwargs)
    with pytest.raises(PreparedDataError, match="different inputs or settings"):
        prepare_preference(tmp_path / "prepared", **dict(kwargs, pairs_per_row=3))


# ------------------------------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def reward_model():
    model = build_model(MODEL, F32, jax.random.key(0), model_class=RewardModel)
    model.score[...] = jax.random.normal(jax.random.key(1), model.score.shape)  # a head that tells sequences apart
    return model


def test_rewards_equal_transformers_sequence_classification_and_import_back(reward_model, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pairs = _random_pairs(1, 6)
    rows, where = pack_pairs(pairs, SEQ, 0, K)
    chosen, rejected, mask = jax.jit(lambda m, b: pair_rewards(m, b, K))(reward_model, rows)
    hf.save_pretrained(reward_model, tmp_path, pad_token_id=0)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(ref).__name__ == "LlamaForSequenceClassification" and ref.config.num_labels == 1
    for (c, r), (row, slot) in zip(pairs, where):
        with torch.no_grad():
            expected = [float(ref(torch.tensor([ids])).logits[0, 0]) for ids, _ in (c, r)]
        np.testing.assert_allclose([chosen[row, slot], rejected[row, slot]], expected, atol=1e-4, rtol=1e-4)
        assert mask[row, slot] == 1
    assert float(mask.sum()) == len(pairs)
    imported = hf.from_pretrained(tmp_path)
    assert isinstance(imported, RewardModel)
    again = jax.jit(lambda m, b: pair_rewards(m, b, K))(imported, rows)
    np.testing.assert_allclose(again[0], chosen, atol=1e-6)


def test_reward_loss_with_all_equal_rewards_is_log_2(reward_model):
    rows, _ = _rows()
    flat = build_model(MODEL, F32, jax.random.key(0), model_class=RewardModel)
    flat.score[...] = jnp.zeros(flat.score.shape)  # every reward is 0
    loss_sum, count, metrics = reward_loss(flat, rows, pairs_per_row=K)
    assert count == 12 and math.isclose(float(loss_sum / count), math.log(2), rel_tol=1e-6)
    assert float(metrics["accuracy"]) == 0.0 and float(metrics["margin"]) == 0.0 and float(metrics["reward_std"]) == 0
    # d loss / d r_c = -1/2 per pair: the head's gradient is -(h_c - h_r) / 2 averaged over pairs
    graphdef, params = nnx.split(flat)
    grads, *_ = grads_and_loss(graphdef, params, rows, loss_fn=functools.partial(reward_loss, pairs_per_row=K))
    h = flat.hidden_states(rows["tokens"], rows["segment_ids"], rows["positions"])
    hidden = lambda side: np.stack([np.asarray(h[r][np.flatnonzero(rows["segment_ids"][r] == 2 * s + 1 + side)[-1]])
                                    for r in range(len(rows["tokens"])) for s in range(K)
                                    if (rows["segment_ids"][r] == 2 * s + 1).any()])
    expected = -(hidden(0) - hidden(1)).mean(0) / 2
    np.testing.assert_allclose(np.asarray(grads["score"][...])[:, 0], expected, atol=1e-6)


# --------------------------------------------------------------------------------------------- DPO


@pytest.fixture(scope="module")
def policy():
    """A LoRA policy whose adapters are not zero (so it differs from its reference)."""
    model = build_model(MODEL, F32, jax.random.key(0), lora=LORA)
    for i, lora in enumerate(adapters_of(model).values()):
        lora.b[...] = 0.1 * jax.random.normal(jax.random.key(10 + i), lora.b.shape)
    return model


def test_the_lora_reference_is_the_base_itself(policy):
    plain = lm_objective(MODEL, F32).graphdef
    reference = reference_model(policy, plain)
    base = nnx.state(policy, nnx.Not(nnx.LoRAParam))
    for (path, ref_leaf), (_, base_leaf) in zip(nnx.to_flat_state(nnx.state(reference)), nnx.to_flat_state(base)):
        assert ref_leaf.get_value() is base_leaf.get_value(), path  # the same arrays: no copy
    rows, _ = _rows()
    base_model = nnx.merge(plain, base)
    logps = jax.jit(lambda m: sequence_logps(m, rows, K))
    assert all(np.array_equal(a, b) for a, b in zip(logps(reference), logps(base_model)))
    assert not np.allclose(logps(policy)[0], logps(reference)[0])


def test_packed_logps_equal_each_sequence_alone(policy):
    pairs = _random_pairs(2, 6)
    rows, where = pack_pairs(pairs, SEQ, 0, K)
    chosen, rejected = jax.jit(lambda m: sequence_logps(m, rows, K))(policy)
    sequences = [side for pair in pairs for side in pair]
    alone = np.zeros((len(sequences), SEQ), np.int32)  # one sequence a row from position 0, right-padded
    for i, (ids, _) in enumerate(sequences):
        alone[i, :len(ids)] = ids
    logp = np.asarray(jax.jit(lambda m, t: jax.nn.log_softmax(m(t), axis=-1))(policy, alone))
    for i, ((ids, mask), (row, slot)) in enumerate(zip(sequences, [w for w in where for _ in range(2)])):
        expected = sum(logp[i, t, ids[t + 1]] for t in range(len(ids) - 1) if mask[t + 1])
        packed = (chosen if i % 2 == 0 else rejected)[row, slot]
        np.testing.assert_allclose(packed, expected, rtol=1e-5)


def test_dpo_at_the_reference_with_tiny_beta_is_log_2_with_gradients_linear_in_beta():
    model = build_model(MODEL, F32, jax.random.key(0), lora=LORA)  # fresh adapters: policy == reference
    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)
    plain = lm_objective(MODEL, F32).graphdef
    rows, _ = _rows()
    grads = {}
    for beta in (1e-4, 2e-4):
        loss_fn = functools.partial(dpo_loss_fn, plain_graphdef=plain, pairs_per_row=K,
                                    dpo=DPOConfig(beta=beta))
        grads[beta], loss, count, metrics = grads_and_loss(graphdef, adapters, rows, loss_fn=loss_fn, frozen=frozen)
        assert math.isclose(float(loss), math.log(2), rel_tol=1e-6) and count == 12
        # B = 0 adds exact zeros, though XLA may round the fused policy matmuls a hair differently
        assert abs(float(metrics["rewards/margins"])) < 1e-9 and abs(float(metrics["rewards/chosen"])) < 1e-9
    small, large = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads[b])]) for b in (1e-4, 2e-4))
    assert np.abs(small).max() > 0
    np.testing.assert_allclose(large, 2 * small, rtol=1e-4, atol=1e-12)


def test_rpo_adds_alpha_times_the_chosen_responses_nll_per_token(policy):
    """dpo.rpo_alpha: the loss grows by alpha x the chosen responses' negative log-likelihood per response token,
    taken from each chosen sequence scored alone (TRL's "sft" term: cross-entropy over the chosen completions)."""
    pairs = _random_pairs(3, 6)
    rows, _ = pack_pairs(pairs, SEQ, 0, K)
    alone = np.zeros((len(pairs), SEQ), np.int32)
    for i, ((ids, _), _) in enumerate(pairs):
        alone[i, :len(ids)] = ids
    logp = np.asarray(jax.jit(lambda m, t: jax.nn.log_softmax(m(t), axis=-1))(policy, alone))
    nll = [-logp[i, t, ids[t + 1]] for i, ((ids, mask), _) in enumerate(pairs) for t in range(len(ids) - 1)
           if mask[t + 1]]
    expected = float(np.mean(nll))
    graphdef, adapters, frozen = nnx.split(policy, nnx.LoRAParam, ...)
    plain = lm_objective(MODEL, F32).graphdef
    out = {}
    for alpha in (0.0, 0.5):
        loss_fn = functools.partial(dpo_loss_fn, plain_graphdef=plain, pairs_per_row=K,
                                    dpo=DPOConfig(beta=0.5, rpo_alpha=alpha))
        out[alpha] = grads_and_loss(graphdef, adapters, rows, loss_fn=loss_fn, frozen=frozen)[1:]
    assert "nll_loss" not in out[0.0][2]
    np.testing.assert_allclose(float(out[0.5][2]["nll_loss"]), expected, rtol=1e-5)
    np.testing.assert_allclose(float(out[0.5][0]) - float(out[0.0][0]), 0.5 * expected, rtol=1e-5)


# ------------------------------------------------------------------------------------------ layouts


def _losses(objective, layout, steps=3):
    mesh = make_mesh(layout if isinstance(layout, MeshConfig) else MeshConfig(*layout))
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    rows, _ = _rows(count=16)
    rows = {k: v[:8] for k, v in rows.items()}
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx, grad_accum=2), shardings, mesh, frozen_shardings)
        batch = to_global(rows, batch_sharding(mesh), 8)
        out = []
        for _ in range(steps):
            state, metrics = step(state, batch, frozen)
            out.append(float(metrics["loss"]))
    return out


def _dpo_objective(pipeline=PipelineConfig()):
    policy = lm_objective(MODEL, F32, pipeline, lora=LORA)
    plain = lm_objective(MODEL, F32, pipeline).graphdef
    return dataclasses.replace(policy, loss_fn=functools.partial(dpo_loss_fn, plain_graphdef=plain, pairs_per_row=K,
                                                                 dpo=DPOConfig(beta=0.5)))


# The reward model with adapters (the filter of adapters plus the fresh head); full fine-tuning shares the rest.
@pytest.mark.parametrize("make", [lambda: reward_model_objective(MODEL, F32, lora=LORA, pairs_per_row=K),
                                  _dpo_objective], ids=["reward_lora", "dpo"])
def test_objectives_agree_across_layouts(make):
    objective = make()
    reference = _losses(objective, (8, 1, 1, 1))
    assert reference[-1] < reference[0]  # it learns
    # the last: each row's sequence split over `context` (the scores read at each sequence's last token)
    for layout in ((1, 8, 1, 1), (2, 2, 2, 1), MeshConfig(data=4, context=2)):
        np.testing.assert_allclose(_losses(objective, layout), reference, rtol=1e-5, err_msg=str(layout))


def test_dpo_through_1f1b_equals_unpipelined():
    """The explicit schedule trains the policy's pass; the reference's (the same base, adapters off) runs forward
    before it and reaches the loss at the last stage."""
    reference = _losses(_dpo_objective(), (8, 1, 1, 1))
    piped = _losses(_dpo_objective(PipelineConfig(microbatches=2, schedule="1f1b")),
                    MeshConfig(data=2, fsdp=2, stage=2))
    np.testing.assert_allclose(piped, reference, rtol=1e-5)
