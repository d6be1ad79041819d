"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE; jaxllm/config/families/) against
transformers 5.25 on random tiny models built from their configs: logits, the auxiliary load-balancing loss, one
step's gradients with the auxiliary loss in them, greedy KV-cache decoding, import of the per-expert files
save_pretrained writes and of the fused layout transformers holds in memory, export back bit for bit; and the
training step of a mixture of experts across mesh layouts, scanned and unrolled, dropless and capacity dispatch.

transformers 5.25's routers take one softmax of the router logits in float32, then the top k (Qwen3-MoE
renormalises them when norm_topk_prob): the behaviour jaxllm matches (not the double softmax of some 2026
releases, which tests/test_moe.py's block parity would catch)."""

import dataclasses
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
from safetensors.torch import save_file  # noqa: E402

from jaxllm.config.schema import (ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig,  # noqa: E402
                                  resolve_moe_exchange)
from jaxllm.config.presets import PRESETS  # noqa: E402
from jaxllm.data.synthetic import synthetic_batch  # noqa: E402
from jaxllm.interop import hf  # noqa: E402
from jaxllm.model.head import next_token_loss  # noqa: E402
from jaxllm.model.moe import router_losses  # noqa: E402
from jaxllm.model.sample import generate  # noqa: E402
from jaxllm.model.transformer import matmul_params, total_params  # noqa: E402
from jaxllm.objectives.pretrain import abstract_train_state, lm_objective  # noqa: E402
from jaxllm.optim.chain import make_optimizer  # noqa: E402
from jaxllm.parallel.mesh import make_mesh  # noqa: E402
from jaxllm.parallel.sharding import spec_tree  # noqa: E402
from jaxllm.runs.checkpoint import Checkpointer  # noqa: E402
from jaxllm.parallel.host_rows import to_global  # noqa: E402
from jaxllm.train.state import init_objective_state  # noqa: E402
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step  # noqa: E402

from hf_models import saved_and_imported  # noqa: E402
from layout_steps import first_updates  # noqa: E402

TOL = 1e-4
AUX_COEF = 0.05
COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, num_experts_per_tok=2, rms_norm_eps=1e-5, initializer_range=0.2,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, router_aux_loss_coef=AUX_COEF)
# 6 experts, 2 per token; the Qwens without renormalisation (Mixtral always renormalises) and with an
# intermediate_size apart from their experts' (never used: every layer has experts); Qwen2-MoE with a shared expert
# of a third size.
CONFIGS = {
    "mixtral": (transformers.MixtralConfig, dict(COMMON, intermediate_size=24, num_local_experts=6)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(COMMON, intermediate_size=40, moe_intermediate_size=24,
                                                    num_experts=6, norm_topk_prob=False)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(COMMON, intermediate_size=40, moe_intermediate_size=24,
                                                    shared_expert_intermediate_size=20, num_experts=6,
                                                    norm_topk_prob=False)),
}
NAMES = list(CONFIGS)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (torch model, its save_pretrained directory, the jaxllm import of it)."""
    return saved_and_imported(tmp_path_factory, CONFIGS)


@pytest.fixture(scope="module")
def ids():
    return np.random.RandomState(0).randint(0, 97, (2, 12))


def _batch(ids):
    inputs, targets = ids[:, :-1], ids[:, 1:]
    return {"tokens": jnp.asarray(inputs, jnp.int32), "targets": jnp.asarray(targets, jnp.int32),
            "segment_ids": jnp.ones(inputs.shape, jnp.int32), "loss_mask": jnp.ones(inputs.shape, jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)}


@pytest.mark.parametrize("name", NAMES)
def test_import_matches_transformers_logits_and_aux_loss(saved, ids, name):
    model, path, jm = saved[name]
    assert (jm.cfg.family, jm.cfg.num_experts, jm.cfg.experts_per_token, jm.cfg.mlp_dim) == (name, 6, 2, 24)
    assert jm.cfg.moe_shared_mlp_dim == (20 if name == "qwen2_moe" else 0)
    assert jm.cfg.moe_renormalize == (name == "mixtral") and jm.cfg.moe_aux_loss_coef == AUX_COEF
    with torch.no_grad():
        out = model(torch.tensor(ids), output_router_logits=True)
    x_BTD, router = jm.hidden_states_and_router(jnp.asarray(ids, jnp.int32))
    assert np.abs(np.asarray(jm.logits(x_BTD)) - out.logits.numpy()).max() < TOL
    aux, _ = router_losses(router, jm.cfg.experts_per_token)  # both layers' tokens taken together
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)


def _torch_grads_in_jaxllm_layout(model) -> dict[tuple, np.ndarray]:
    """{jaxllm parameter path: gradient} of the torch model after a backward pass (experts fused in memory:
    gate_up_proj [L][E, 2F, D], down_proj [L][E, D, F]; a shared expert's Linear weights [out, in])."""
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    L = model.config.num_hidden_layers
    stack = lambda name: np.stack([grads[f"model.layers.{i}.{name}"] for i in range(L)])
    gate_up = stack("mlp.experts.gate_up_proj")
    F = gate_up.shape[2] // 2
    out = {("layers", "mlp", "router"): np.swapaxes(stack("mlp.gate.weight"), 1, 2),
           ("layers", "mlp", "gate_proj"): np.swapaxes(gate_up[:, :, :F], 2, 3),
           ("layers", "mlp", "up_proj"): np.swapaxes(gate_up[:, :, F:], 2, 3),
           ("layers", "mlp", "down_proj"): np.swapaxes(stack("mlp.experts.down_proj"), 2, 3),
           ("layers", "self_attn", "o_proj"): stack("self_attn.o_proj.weight"),  # compared by norm below
           ("embed_tokens", "embedding"): grads["model.embed_tokens.weight"]}
    if "model.layers.0.mlp.shared_expert_gate.weight" in grads:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[("layers", "mlp", f"shared_{name}")] = np.swapaxes(stack(f"mlp.shared_expert.{name}.weight"), 1, 2)
        out[("layers", "mlp", "shared_expert_gate")] = np.swapaxes(stack("mlp.shared_expert_gate.weight"), 1, 2)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_one_step_gradients_with_the_aux_loss_match_torch_autograd(saved, ids, name):
    """transformers' training loss is cross-entropy + router_aux_loss_coef * aux; jaxllm reports the cross-entropy
    and the aux loss apart, and its gradient carries both: each equals torch autograd's."""
    model, _, jm = saved[name]
    graphdef, params = nnx.split(jm)

    def loss(p):
        total, count, metrics = next_token_loss(nnx.merge(graphdef, p), _batch(ids))
        return total / count, metrics

    (ce, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    model.zero_grad()
    # transformers' loss as its forward with labels adds it up, on the same 11 input positions as jaxllm's (with
    # labels it would route all 12)
    out = model(torch.tensor(ids[:, :-1]), output_router_logits=True)
    torch_ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), torch.tensor(ids[:, 1:]).flatten())
    torch_loss = torch_ce + model.config.router_aux_loss_coef * out.aux_loss
    torch_loss.backward()
    np.testing.assert_allclose(float(ce), float(torch_ce.detach()), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["moe_aux_loss"]), float(out.aux_loss.detach()), rtol=1e-5)
    theirs = _torch_grads_in_jaxllm_layout(model)
    for path, reference in theirs.items():
        ours = grads
        for key in path:
            ours = ours[key]
        ours = np.asarray(ours.get_value())
        if path[-1] == "o_proj":  # [L, N, H, D] here, [L, D, N*H] there: the same entries
            ours, reference = np.sort(ours.ravel()), np.sort(reference.ravel())
        assert np.abs(ours - reference).max() <= TOL * np.abs(reference).max(), path


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_matches_transformers_generate(saved, name):
    model, _, jm = saved[name]
    prompts = [[5, 17, 42, 8], [3, 9, 77, 21, 60, 11]]
    for prompt, new in zip(prompts, generate(jm, prompts, max_new_tokens=10)):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert new == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_transformers_per_expert_files_and_round_trips_bit_for_bit(saved, ids, tmp_path, name):
    model, path, jm = saved[name]
    hf.save_pretrained(jm, tmp_path)
    written = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"] if (
        tmp_path / "model.safetensors.index.json").exists() else None
    from safetensors.numpy import load_file
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
    assert written is None and sorted(ours) == sorted(theirs)  # the names transformers' save_pretrained writes
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(torch.tensor(ids)).logits, model(torch.tensor(ids)).logits)
    assert hf.from_pretrained(tmp_path).cfg == jm.cfg


@pytest.mark.parametrize("name", NAMES)
def test_import_reads_the_fused_expert_layout_too(saved, tmp_path, name):
    """A file with the experts as transformers 5 holds them in memory (mlp.experts.gate_up_proj [E, 2F, D],
    down_proj [E, D, F], mlp.gate) imports to the same parameters."""
    model, path, jm = saved[name]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    fused = hf.from_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(nnx.state(jm)), jax.tree.leaves(nnx.state(fused)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unsupported_moe_options_are_one_line_errors_naming_the_key(saved):
    config = json.loads((saved["qwen3_moe"][1] / "config.json").read_text())
    with pytest.raises(ValueError, match="mlp_only_layers"):
        hf.config_from_hf(dict(config, mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="router_jitter_noise"):
        hf.config_from_hf(dict(json.loads((saved["mixtral"][1] / "config.json").read_text()), router_jitter_noise=0.1))
    with pytest.raises(ConfigError, match="model.num_experts: family 'llama' has a dense MLP"):
        ModelConfig(num_experts=4).check()
    with pytest.raises(ConfigError, match="model.num_experts: family 'mixtral' is a mixture of experts"):
        ModelConfig(family="mixtral").check()
    with pytest.raises(ConfigError, match="model.moe_renormalize: family 'mixtral' always"):
        ModelConfig(**dict(PRESETS["moe_tiny"], moe_renormalize=False)).check()
    qwen2_moe = json.loads((saved["qwen2_moe"][1] / "config.json").read_text())
    for key, value in (("shared_expert_intermediate_size", 0), ("decoder_sparse_step", 2), ("qkv_bias", False),
                       ("use_sliding_window", True)):
        with pytest.raises(ValueError, match=key) as raised:
            hf.config_from_hf(dict(qwen2_moe, **{key: value}))
        assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match="model.moe_shared_mlp_dim: family 'mixtral' has no shared expert"):
        ModelConfig(**dict(PRESETS["moe_tiny"], moe_shared_mlp_dim=32)).check()
    for bad in (0, -8):
        with pytest.raises(ConfigError, match="model.moe_shared_mlp_dim: family 'qwen2_moe' has a shared expert"):
            ModelConfig(**dict(PRESETS["qwen2_moe_a2_7b"], moe_shared_mlp_dim=bad)).check()


def test_presets_count_total_and_active_parameters():
    """Mixtral 8x7B: 46.7B parameters, 12.9B active a token (with the embeddings); Qwen3-30B-A3B: 30.5B, 3.3B;
    Qwen1.5-MoE-A2.7B: 14.3B, 2.7B (its shared expert active on every token)."""
    for preset, total, active in (("mixtral_8x7b", 46.70e9, 12.88e9), ("qwen3_30b_a3b", 30.53e9, 3.35e9),
                                  ("qwen2_moe_a2_7b", 14.32e9, 2.69e9)):
        cfg = ModelConfig(**PRESETS[preset])
        cfg.check()
        assert abs(total_params(cfg) - total) < 0.01e9, preset
        assert abs(matmul_params(cfg) + cfg.dim * cfg.vocab_size - active) < 0.01e9, preset


# (data, fsdp, tensor, stage, expert): every axis, expert = 2 and 4 with tensor, data and stage mixed in (expert 8
# and fsdp x tensor x expert a layer at a time: tests/test_expert_exchange.py)
LAYOUTS = {"data": MeshConfig(8), "pipeline": MeshConfig(1, 2, 2, 2),
           "expert 2 + tensor + data": MeshConfig(2, 1, 2, expert=2),
           "expert 4 + stage": MeshConfig(1, 1, 1, 2, expert=4)}
# capacity dispatch: a different code path on each side of the pipeline's edge, and with the expert exchange
CAPACITY_LAYOUTS = ("data", "pipeline", "expert 2 + tensor + data")
# dropless dispatch with the ragged exchange (model.moe_exchange; an all-gather stands in for the op on XLA:CPU;
# tests/test_expert_exchange.py compares it with the gather on more layouts, a layer at a time)
RAGGED_LAYOUTS = {"expert 2 + context + tensor, ragged": MeshConfig(1, 1, 2, expert=2, context=2),
                  "expert 4 + fsdp, ragged": MeshConfig(1, 2, expert=4)}


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_moe_training_steps_agree_across_layouts(dispatch):
    """moe_tiny's pretraining step (aux and z losses on) over data / fsdp / tensor / stage / expert layouts: the
    same losses, aux losses, router statistics and gradient norms over two updates; dropless through both
    expert exchanges. 16 rows, 8 a micro-batch, so every layout's expert group splits them (the exchanges run).
    Capacity dispatch (a factor of 1, which drops picks) too: capacity is per row, so what is dropped does not
    depend on the layout."""
    cfg = ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=128, moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01,
                             moe_dispatch=dispatch, moe_capacity_factor=1.0))
    batch = synthetic_batch(3, 16, 16, 128)
    names = ("loss", "moe_aux_loss", "moe_z_loss", "moe/expert_tokens_cv/layer_1", "moe/moe_dropped_fraction/layer_0",
             "grad_norm")
    layouts = {name: (LAYOUTS[name], cfg) for name in (CAPACITY_LAYOUTS if dispatch == "capacity" else LAYOUTS)}
    if dispatch == "dropless":
        layouts.update({name: (layout, dataclasses.replace(cfg, moe_exchange="ragged"))
                        for name, layout in RAGGED_LAYOUTS.items()})
    losses = {name: first_updates(lambda pipeline: lm_objective(model, F32, pipeline), layout, batch, names, steps=2)
              for name, (layout, model) in layouts.items()}
    reference = losses["data"]
    assert reference[1][0] < reference[0][0]
    assert all((fraction > 0.05) == (dispatch == "capacity") for *_, fraction, _ in reference)
    for name in list(losses)[1:]:
        np.testing.assert_allclose(losses[name], reference, rtol=1e-5, atol=1e-6, err_msg=name)


def test_auto_exchange_is_ragged_only_where_the_backend_has_it_and_the_experts_span_hosts(monkeypatch):
    """`model.moe_exchange=auto`: the gather within a host and on XLA:CPU, the ragged all-to-all across hosts."""
    across_hosts, one_host = MeshConfig(1, 2, expert=8, dcn_fsdp=1, dcn_expert=2), MeshConfig(2, expert=8)
    assert resolve_moe_exchange(across_hosts) == resolve_moe_exchange(one_host) == "gather"  # XLA:CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert (resolve_moe_exchange(across_hosts), resolve_moe_exchange(one_host)) == ("ragged", "gather")


def test_unrolled_layers_and_roomy_capacity_equal_scanned_dropless():
    """The layers unrolled, and capacity dispatch with room for every pick, give dropless scanned updates."""
    cfg = ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=128, moe_aux_loss_coef=0.1))
    batch = synthetic_batch(3, 8, 16, 128)
    run = lambda model: first_updates(lambda pipeline: lm_objective(model, F32, pipeline), MeshConfig(2, 2, 2),
                                      batch, ("loss", "moe_aux_loss"))
    reference = run(cfg)
    roomy = dataclasses.replace(cfg, moe_dispatch="capacity", moe_capacity_factor=cfg.num_experts / 2)
    for model in (dataclasses.replace(cfg, scan_layers=False), roomy):
        np.testing.assert_allclose(run(model), reference, rtol=1e-5)


def test_a_shared_expert_trains_alike_across_layouts():
    """moe_tiny as Qwen2-MoE with a shared expert (a dense MLP outside the experts' shard_map): the same losses
    and aux losses over two updates on data, tensor + expert and pipeline layouts (the expert layers run outside a
    shard_map in pipeline stages); and the shared expert's kernels split over tensor as a dense MLP's."""
    cfg = ModelConfig(**dict(PRESETS["moe_tiny"], family="qwen2_moe", vocab_size=128, moe_renormalize=False,
                             moe_shared_mlp_dim=32, moe_aux_loss_coef=0.1))
    batch = synthetic_batch(3, 8, 16, 128)
    run = lambda model, layout: first_updates(lambda pipeline: lm_objective(model, F32, pipeline), layout, batch,
                                              ("loss", "moe_aux_loss"), steps=2)
    reference = run(cfg, MeshConfig(8))
    assert reference[1][0] < reference[0][0]
    for name, layout in (("expert 2 + tensor + data", MeshConfig(2, 1, 2, expert=2)),
                         ("pipeline", MeshConfig(1, 2, 2, 2))):
        np.testing.assert_allclose(run(cfg, layout), reference, rtol=1e-5, atol=1e-6, err_msg=name)
    mesh = make_mesh(MeshConfig(1, 2, 2, expert=2))
    specs = spec_tree(abstract_train_state(cfg, F32, make_optimizer(OptimConfig(), 10)).params, mesh)["layers"]["mlp"]
    assert (specs["shared_gate_proj"], specs["shared_down_proj"], specs["shared_expert_gate"]) == (
        P(None, "fsdp", "tensor"), P(None, "tensor", "fsdp"), P(None, "fsdp", None))


def test_checkpoints_reshard_between_expert_counts_and_resume_bitwise(tmp_path):
    """A moe_tiny train state saved after 2 steps on expert=4 (with fsdp) restores bit for bit on expert=1, 2 (with
    tensor) and 8, each device holding its share of the experts; restored on the mesh that saved it, 2 more steps
    equal 4 uninterrupted ones bit for bit."""
    cfg = ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=128, moe_aux_loss_coef=0.1))
    objective = lm_objective(cfg, F32)
    tx = make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0), 10)
    mesh = make_mesh(MeshConfig(1, 2, expert=4))
    batch = synthetic_batch(3, 8, 16, 128)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx, grad_accum=2), shardings, mesh, frozen_shardings)
        placed = to_global(batch, batch_sharding(mesh), 8)
        for _ in range(2):
            state, _ = step(state, placed, frozen)
        ckpt = Checkpointer(tmp_path / "ckpt")
        ckpt.save(2, state, {"step": 2}, {})
        ckpt.wait()
        saved = [np.asarray(x) for x in jax.tree.leaves(state)]
        for _ in range(2):
            state, _ = step(state, placed, frozen)
        uninterrupted = [np.asarray(x) for x in jax.tree.leaves(state)]
    abstract = abstract_train_state(cfg, F32, tx)
    for layout, experts_per_device in ((MeshConfig(8), 8), (MeshConfig(2, 1, 2, expert=2), 4),
                                       (MeshConfig(expert=8), 1), (MeshConfig(1, 2, expert=4), 2)):
        other = make_mesh(layout)
        restored = ckpt.restore(2, abstract, other)["state"]
        gate = restored.params["layers"]["mlp"]["gate_proj"][...]
        assert gate.addressable_shards[0].data.shape[1] == experts_per_device, (layout, gate.sharding.spec)
        assert all(np.array_equal(np.asarray(a), b, equal_nan=True) for a, b in zip(jax.tree.leaves(restored), saved)), layout
    with jax.set_mesh(mesh):  # the last restore was onto the saving mesh: resume there
        for _ in range(2):
            restored, _ = step(restored, placed, frozen)
    assert all(np.array_equal(np.asarray(a), b, equal_nan=True) for a, b in zip(jax.tree.leaves(restored), uninterrupted))
    ckpt.close()
