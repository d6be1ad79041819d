"""QLoRA: a frozen base stored in NF4 or int8 (`lora.base_quant`). NF4 equals bitsandbytes' (code book, packing,
absmax, dequantisation), int8 round-trips within its own definition, a quantised model computes what the same
model with its base dequantised computes, a base loads quantised kernel by kernel to the same arrays on any
layout with the float base's fingerprint, KV-cache sampling and the merged export work on it, and a QLoRA SFT run
resumes bitwise."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train_runs import losses, preempt_at, run_sft, sft_command

from jaxllm.config.schema import LORA_TARGETS, ConfigError, LoRAConfig, MeshConfig, ModelConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.interop import hf
from jaxllm.model import blockwise
from jaxllm.model.base_quant import QuantizedBase, QuantizedKernel, dequantized, quantize_kernel
from jaxllm.model.build import build_model
from jaxllm.model.actor_critic import ActorCritic
from jaxllm.model.lora import adapters_of, adapters_off
from jaxllm.model.reference import reference_model
from jaxllm.model.sample import generate
from jaxllm.parallel.mesh import make_mesh
from jaxllm.runs import base_model
from jaxllm.runs.loader import load_base, load_checkpoint

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes.functional")

MODEL = ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
BATCH = synthetic_batch(2, 4, 16, MODEL.vocab_size)


def test_bad_settings_are_config_errors():
    for settings, message in (({"base_quant": "nf3"}, "is not one of"), ({"base_quant": "nf4", "rank": 0},
                                                                            "needs adapters")):
        with pytest.raises(ConfigError, match=message) as raised:
            LoRAConfig(**settings).check()
        assert raised.value.key == "lora.base_quant"


def _lora(mode):
    return LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=",".join(LORA_TARGETS), base_quant=mode)


@pytest.mark.parametrize("shape,dtype", [((64, 256), np.float32), ((33, 70), np.float32), ((7,), np.float32),
                                         ((128, 192), "bfloat16")])
def test_nf4_equals_bitsandbytes(shape, dtype):
    w = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32) * 0.02
    levels = blockwise.NF4_LEVELS
    on_midpoints = np.concatenate([(levels[:-1] + levels[1:]) / np.float32(2), [1.0]])  # absmax 1: ties stay ties
    if w.size >= 80:
        w.reshape(-1)[64:80] = on_midpoints  # the second block: where a tie rounds must agree too
    reference = torch.from_numpy(w)
    if dtype == "bfloat16":
        reference = reference.to(torch.bfloat16)
        w = reference.float().numpy()  # the same bf16 values in float32
    packed, state = bnb.quantize_4bit(reference, blocksize=64, quant_type="nf4")
    ours, absmax = blockwise.nf4_quantize(jnp.asarray(w, jnp.bfloat16) if dtype == "bfloat16" else w)
    assert np.array_equal(np.asarray(ours), packed.numpy().reshape(-1))
    assert np.array_equal(np.asarray(absmax), state.absmax.numpy())
    assert np.array_equal(blockwise.NF4_LEVELS, state.code.numpy())
    values = np.asarray(blockwise.nf4_dequantize(ours, absmax, shape, dtype=jnp.dtype(dtype))).astype(np.float32)
    # bitsandbytes' CPU dequantisation kernel takes blocks per row, which is its flattened layout only when a row
    # is a whole number of blocks; its portable dequantisation is the reference otherwise
    if shape[-1] % 64 == 0:
        expected = bnb.dequantize_4bit(packed, state).float().numpy()
    else:
        from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
        expected = _dequantize_4bit_compute(packed.reshape(-1), state.absmax, state.code, 64, shape,
                                            torch.float32).numpy()
    assert np.array_equal(values, expected)


def test_a_kernels_codes_are_bitsandbytes_codes_of_its_hugging_face_tensor():
    model = _adapted("nf4")
    floating = build_model(MODEL, F32, jax.random.key(0), lora=_lora("none"))
    kernel = np.asarray(floating.layers.self_attn.q_proj[...][0])  # layer 0, [D, N, H]
    hf_weight = torch.from_numpy(kernel.reshape(kernel.shape[0], -1).T.copy())  # q_proj.weight [N * H, D]
    packed, _ = bnb.quantize_4bit(hf_weight, blocksize=64, quant_type="nf4")
    codes = np.asarray(model.layers.self_attn.q_proj.codes[...][0])  # [D / 2, N, H]
    assert np.array_equal(codes.reshape(codes.shape[0], -1).T.reshape(-1), packed.numpy().reshape(-1))


def test_double_quantised_scales_follow_bitsandbytes():
    w = np.random.default_rng(0).standard_normal((64, 64 * 300)).astype(np.float32)
    _, nested = bnb.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4", compress_statistics=True)
    assert np.abs(blockwise.dynamic_code() - nested.state2.code.numpy()).max() <= 6e-8  # float64 vs float32 linspace
    _, absmax = blockwise.nf4_quantize(w)
    offset = jnp.mean(absmax)  # equal to bitsandbytes' up to the summation order's last bit
    codes, scale = blockwise.quantize_scales(jnp.pad(absmax - offset, (0, -absmax.size % 256)).reshape(-1, 256), 0.0)
    assert np.allclose(np.asarray(scale), nested.state2.absmax.numpy(), rtol=1e-6, atol=0)
    assert np.mean(np.asarray(codes).reshape(-1)[:absmax.size] != nested.absmax.numpy()) < 0.005  # on midpoints
    ours = np.asarray(blockwise.dequantize_scales(codes, scale, offset)).reshape(-1)[:absmax.size]
    theirs = bnb.dequantize_blockwise(nested.absmax, nested.state2).numpy() + nested.offset.item()
    step = (1 - 0.1) / 64 * float(scale.max())  # the dynamic code's widest spacing, scaled
    assert np.abs(ours - theirs).max() <= step
    assert np.abs(ours - np.asarray(absmax)).max() <= step  # 8 bits of the scale


def test_int8_round_trips_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((96, 100)).astype(np.float32)
    codes, absmax = blockwise.int8_quantize(w)
    assert codes.dtype == jnp.int8 and absmax.shape == (-(-w.size // 64),)
    back = np.asarray(blockwise.int8_dequantize(codes, absmax, w.shape)).reshape(-1)
    step = np.repeat(np.asarray(absmax), 64)[:w.size] / 127
    assert np.all(np.abs(back - w.reshape(-1)) <= step / 2 * (1 + 1e-6))
    blocks = np.pad(w.reshape(-1), (0, -w.size % 64)).reshape(-1, 64)
    assert np.array_equal(np.asarray(absmax), np.abs(blocks).max(-1))  # the symmetric absmax, one a block
    assert set(np.abs(np.asarray(codes)).max(axis=None, keepdims=True).ravel()) == {127}


@functools.cache
def _adapted(mode):
    """A model with adapters on every target (B random) and its base stored as `mode` says."""
    model = build_model(MODEL, F32, jax.random.key(0), lora=_lora(mode))
    for i, adapter in enumerate(adapters_of(model).values()):
        adapter.b[...] = 0.05 * jax.random.normal(jax.random.key(i), adapter.b.shape)
    return model


def _logits(model):
    return np.asarray(model(BATCH["tokens"], BATCH["segment_ids"], BATCH["positions"]))


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_quantised_base_computes_as_its_dequantised_float_base(mode):
    quantised = _adapted(mode)
    kernels = nnx.state(quantised, QuantizedBase)
    assert all(isinstance(getattr(quantised.layers.mlp, t), QuantizedKernel) for t in ("gate_proj", "down_proj"))
    floating = build_model(MODEL, F32, jax.random.key(0), lora=_lora("none"))
    nnx.update(floating, dequantized(quantised, nnx.state(quantised, nnx.Not(nnx.LoRAParam)), jnp.float32))
    nnx.update(floating, nnx.state(quantised, nnx.LoRAParam))
    assert np.abs(_logits(quantised) - _logits(floating)).max() < 1e-5
    plain = build_model(MODEL, F32, jax.random.key(0), lora=_lora("none"))  # what was quantised: close, not equal
    error = jnp.linalg.norm(floating.layers.mlp.up_proj[...] - plain.layers.mlp.up_proj[...])
    assert 0 < error / jnp.linalg.norm(plain.layers.mlp.up_proj[...]) < (0.12 if mode == "nf4" else 0.01)
    bits = 8 * sum(x.nbytes for x in jax.tree.leaves(kernels)) / sum(
        x.size for x in jax.tree.leaves(nnx.state(plain.layers, nnx.Not(nnx.LoRAParam))) if x.ndim > 2)
    assert bits < (4.6 if mode == "nf4" else 8.7)  # o_proj's toy blocks of 16 (head_dim) cost a little more


def _step_temporaries(mode):
    """Temporary bytes of the adapters' gradient step compiled with no remat."""
    model = build_model(MODEL, F32, jax.random.key(0), lora=_lora(mode))
    graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)
    tokens = BATCH["tokens"][:1, :8]

    def loss(trainable, frozen):
        return jnp.mean(nnx.merge(graphdef, trainable, frozen)(tokens, jnp.ones_like(tokens),
                                                                jnp.arange(8)[None]) ** 2)

    return jax.jit(jax.grad(loss)).lower(trainable, frozen).compile().memory_analysis().temp_size_in_bytes


def test_the_backward_pass_keeps_no_float_copy_of_the_base():
    kernels = sum(x.nbytes for x in jax.tree.leaves(nnx.state(_adapted("none").layers, nnx.Not(nnx.LoRAParam)))
                  if x.ndim > 2)
    assert _step_temporaries("nf4") < _step_temporaries("none") + kernels / 2


def test_the_adapters_off_reference_and_the_critic_share_the_quantised_base():
    lora = _lora("nf4")
    policy = _adapted("nf4")
    plain = jax.eval_shape(lambda: nnx.split(build_model(MODEL, F32, jax.random.key(0), lora=adapters_off(lora))))[0]
    reference = reference_model(policy, plain)  # DPO's, PPO's and GRPO's frozen reference
    assert reference.lora is None and reference.layers.mlp.up_proj.codes is policy.layers.mlp.up_proj.codes
    without = build_model(MODEL, F32, jax.random.key(0), lora=lora)  # the same model, adapters at B = 0
    nnx.update(without, nnx.state(policy, nnx.Not(nnx.LoRAParam)))
    assert np.array_equal(_logits(reference), _logits(without))
    assert adapters_off(_lora("none")) is None  # a float base's view is the plain model
    critic_of = build_model(MODEL, F32, jax.random.key(0), lora=lora, model_class=ActorCritic)  # PPO: one base
    assert critic_of.value.layers.self_attn.q_proj is critic_of.layers.self_attn.q_proj


@pytest.mark.parametrize("mode", ["nf4"])
def test_kv_cache_sampling_and_the_merged_export_on_a_quantised_base(mode, tmp_path):
    quantised = _adapted(mode)
    floating = build_model(MODEL, F32, jax.random.key(0), lora=_lora("none"))
    nnx.update(floating, dequantized(quantised, nnx.state(quantised, nnx.Not(nnx.LoRAParam)), jnp.float32))
    nnx.update(floating, nnx.state(quantised, nnx.LoRAParam))
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9]]
    for temperature in (0.0, 1.0):  # greedy and sampled
        ours = generate(quantised, prompts, max_new_tokens=8, temperature=temperature)
        assert ours == generate(floating, prompts, max_new_tokens=8, temperature=temperature)
    hf.save_pretrained(quantised, tmp_path / "merged")  # merged into a float model
    assert np.abs(_logits(hf.from_pretrained(tmp_path / "merged")) - _logits(quantised)).max() < 1e-5
    hf.save_pretrained(quantised, tmp_path / "adapter", adapter_only=True)  # PEFT's format, onto the float base
    base = build_model(MODEL, F32, jax.random.key(0))  # the dequantised base alone
    nnx.update(base, nnx.state(floating, nnx.Not(nnx.LoRAParam)))
    hf.save_pretrained(base, tmp_path / "base")
    applied = hf.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    assert np.abs(_logits(applied) - _logits(quantised)).max() < 1e-5


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_base")
    hf.save_pretrained(build_model(MODEL, F32, jax.random.key(3)), path)
    return base_model.locate(str(path))


def _load(base, mode, mesh):
    abstract = jax.eval_shape(lambda: nnx.split(build_model(MODEL, F32, jax.random.key(0), lora=_lora(mode)),
                                                nnx.LoRAParam, ...)[2])
    with jax.set_mesh(mesh):
        return load_base(base, abstract, mesh)


def test_a_base_loads_quantised_alike_on_every_layout_with_the_float_base_fingerprint(hf_base):
    layouts = [MeshConfig(data=8), MeshConfig(data=2, fsdp=2, tensor=2), MeshConfig(data=1, fsdp=4, tensor=2)]
    _, float_identity = _load(hf_base, "none", make_mesh(layouts[0]))
    loaded = [_load(hf_base, "nf4", make_mesh(layout)) for layout in layouts]
    assert {identity for _, identity in loaded} == {float_identity}
    first = jax.tree.leaves(loaded[0][0])
    split = [x.sharding.spec for x in jax.tree.leaves(loaded[2][0]) if x.dtype == jnp.uint8 and x.ndim == 4]
    assert any("fsdp" in str(spec) and "tensor" in str(spec) for spec in split)  # sharded as the float kernels
    for params, _ in loaded[1:]:
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, jax.tree.leaves(params)))
    graphdef = nnx.split(build_model(MODEL, F32, jax.random.key(0), lora=_lora("nf4")), nnx.LoRAParam, ...)[0]
    trainable = nnx.state(_adapted("nf4"), nnx.LoRAParam)
    logits = []
    for layout, (params, _) in zip(layouts, loaded):  # and compute alike: the forward pass on each layout
        with jax.set_mesh(make_mesh(layout)):
            logits.append(np.asarray(jax.jit(lambda t, f: nnx.merge(graphdef, t, f)(
                BATCH["tokens"], BATCH["segment_ids"], BATCH["positions"]))(trainable, params)))
    assert all(np.abs(other - logits[0]).max() < 1e-5 for other in logits[1:])
    # the loaded kernels are the float base's within NF4's rounding (half its widest step, 0.139 of a block's absmax)
    float_params, _ = _load(hf_base, "none", make_mesh(layouts[1]))
    model = build_model(MODEL, F32, jax.random.key(0), lora=_lora("nf4"))
    nnx.update(model, loaded[1][0])
    for name in ("q_proj", "o_proj"):
        kernel = getattr(model.layers.self_attn, name)  # read layer by layer: the whole stack's quantisation
        whole = quantize_kernel(float_params["layers"]["self_attn"][name][...], kernel.codes)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(nnx.state(kernel))))
        floating = float_params["layers"]["self_attn"][name][...]
        error = kernel.dequantize(jnp.float32) - floating
        assert 0 < jnp.abs(error).max() <= 0.139 * jnp.abs(floating).max()


@pytest.fixture(scope="module")
def qlora_run(bases, sft_task, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("qlora")
    proc = run_sft(bases[0], sft_task, workdir, "--config.train.steps=6", "--config.lora.base_quant=nf4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_qlora_sft_resumes_bitwise_on_its_base_fingerprint(bases, sft_task, qlora_run, lora_run, tmp_path):
    command = sft_command(bases[0], sft_task, tmp_path, "--config.train.steps=6", "--config.lora.base_quant=nf4")
    assert preempt_at(command, tmp_path, 3) == 3
    again = run_sft(bases[0], sft_task, tmp_path, "--config.train.steps=6", "--config.lora.base_quant=nf4")
    assert again.returncode == 0, again.stderr[-3000:]
    full, resumed = losses(qlora_run), losses(tmp_path)
    assert all(resumed[s] == full[s] for s in range(4, 7)), (resumed, full)
    assert full != losses(lora_run)  # trained on the quantised base, not the float one
    tuned = load_checkpoint(str(qlora_run))
    assert tuned.meta["base"]["fingerprint"] == load_checkpoint(str(lora_run)).meta["base"]["fingerprint"]
    assert jax.tree.leaves(nnx.state(tuned.model, QuantizedBase))  # evaluated on the base it trained on
    for a, b in zip(jax.tree.leaves(load_checkpoint(str(tmp_path)).params), jax.tree.leaves(tuned.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
