"""`precision.quant` (jaxllm/model/quant.py): with int8 the compiled train step's block weight matmuls are int8 x int8
dots in the forward and both backward passes while the output head's stay in float, the default step has none,
the tiny model trains to float32's loss within 2%, and combinations that cannot work are one-line config errors.
With fp8 the same matmuls are e4m3 x e4m3 dots forward and e5m2-gradient dots backward in the program JAX hands
to XLA (XLA:CPU then widens them to float32, so the check reads the lowered StableHLO), and it trains too."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config.schema import ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.quant import expert_ragged_dot, weight_einsum
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.host_rows import to_global
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.train.state import init_objective_state
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
LAYOUT = MeshConfig(2, 2, 2, 1)
ROWS, SEQ, STEPS = 8, 16, 5
# q, k, v, o, gate, up, down: each has a forward dot and two backward dots (einsum specs as in the op names).
BLOCK_MATMULS = {"BTD,DNH->BTNH", "BSD,DKH->BSKH", "BTNH,NHD->BTD", "BTD,DF->BTF", "BTF,FD->BTD"}
QUANTISED_MATMULS = 7
HEAD_MATMUL = "BTD,DV->BTV"  # the output head: kept in float (jaxllm/model/quant.py says why)
# HLO instructions: `%name = type[shape]... ` and dots `%name = type[...] dot(%lhs, %rhs), ... op_name="..."`.
DEFINITION = re.compile(r"^\s*(?:ROOT )?(%\S+) = (\w+)\[")
DOT = re.compile(r"^\s*(?:ROOT )?%\S+ = (\w+)\[[^=]*? dot\((%[^,\s)]+), (%[^,\s)]+)\)")


def dots(hlo: str) -> list[tuple[tuple[str, str, str], str]]:
    """((output, lhs, rhs) element types, metadata op_name) of every dot in compiled HLO text (operand types are
    looked up in the computation that holds the dot: in a fusion they are its parameters)."""
    found, types = [], {}
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a new computation: its own instruction names
            types = {}
        if definition := DEFINITION.match(line):
            types[definition.group(1)] = definition.group(2)
        if dot := DOT.match(line):
            name = re.search(r'op_name="([^"]*)"', line)
            operand_types = (dot.group(1), types.get(dot.group(2)), types.get(dot.group(3)))
            found.append((operand_types, name.group(1) if name else ""))
    return found


def int8_dots(hlo: str) -> list[str]:
    """The op_name of every s8 x s8 -> s32 dot in compiled HLO text."""
    return [name for types, name in dots(hlo) if types == ("s32", "s8", "s8")]


# StableHLO with locations: `%x = stablehlo.dot_general ... : (tensor<AxBxf8E4M3FN>, tensor<...>) -> ... loc(#locN)`
# and `#locN = loc("op name"(#locM))` definitions, or aliases of other locations, at the end of the module.
STABLEHLO_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\).* loc\((#loc\d+)\)$")
LOCATION = re.compile(r"^(#loc\d+) = (.*)$", re.M)


def stablehlo_dots(text: str) -> list[tuple[tuple[str, str], str]]:
    """((lhs, rhs) element types, op name) of every dot_general in StableHLO text lowered with debug_info."""
    locations = dict(LOCATION.findall(text))

    def name(loc: str) -> str:
        for _ in range(100):  # follow aliases to the first location that carries a name
            definition = locations.get(loc, "")
            if quoted := re.search(r'"([^"]*)"', definition):
                return quoted.group(1)
            if not (alias := re.search(r"#loc\d+", definition)):
                return ""
            loc = alias.group(0)
        return ""

    return [((m.group(1), m.group(2)), name(m.group(3)))
            for m in map(STABLEHLO_DOT.search, text.splitlines()) if m]


def _train(quant: str):
    """(HLO text, losses over STEPS steps on one repeated batch) of the tiny float32 model: compiled HLO, or
    for fp8 the lowered StableHLO (XLA:CPU widens float8 dots to float32 when it compiles)."""
    precision = PrecisionConfig(params="float32", compute="float32", output="float32", quant=quant)
    mesh, objective = make_mesh(LAYOUT), lm_objective(MODEL, precision)
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx), shardings, mesh)
        batch = to_global(synthetic_batch(0, ROWS, SEQ, MODEL.vocab_size), batch_sharding(mesh), ROWS)
        lowered = step.lower(state, batch)
        hlo = lowered.as_text(debug_info=True) if quant == "fp8" else lowered.compile().as_text()
        losses = []
        for _ in range(STEPS):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return hlo, losses


@pytest.fixture(scope="module")
def runs():
    return {quant: _train(quant) for quant in ("none", "int8", "fp8")}


def test_int8_step_has_int8_dots_forward_and_backward(runs):
    names = int8_dots(runs["int8"][0])
    backward = [name for name in names if "transpose(" in name]  # autodiff's transpose: the backward pass
    assert len(names) - len(backward) >= QUANTISED_MATMULS, names
    assert len(backward) >= 2 * QUANTISED_MATMULS, names
    assert {spec for spec in BLOCK_MATMULS if any(f"/{spec}/" in name for name in names)} == BLOCK_MATMULS, names


def test_int8_step_keeps_the_output_head_in_float(runs):
    head = [(types, name) for types, name in dots(runs["int8"][0]) if HEAD_MATMUL in name]
    assert len(head) >= 3, head  # its forward dot and both backward dots are there ...
    assert all(types == ("f32", "f32", "f32") for types, _ in head), head  # ... and none is int8


def test_default_step_has_no_int8(runs):
    hlo = runs["none"][0]
    assert not int8_dots(hlo)
    assert "s8[" not in hlo


def test_int8_trains_close_to_float32(runs):
    f32, int8 = runs["none"][1], runs["int8"][1]
    assert all(map(jax.numpy.isfinite, int8)), int8
    assert int8[-1] < int8[0] - 0.1, int8
    assert abs(int8[-1] / f32[-1] - 1) < 0.02, (int8, f32)


def test_fp8_step_has_e4m3_dots_forward_and_e5m2_gradients_backward(runs):
    found = stablehlo_dots(runs["fp8"][0])
    forward = [name for types, name in found if types == ("f8E4M3FN", "f8E4M3FN")]
    backward = [name for types, name in found if types == ("f8E5M2", "f8E4M3FN")]
    assert len(forward) == QUANTISED_MATMULS and len(backward) == 2 * QUANTISED_MATMULS, found
    for names in (forward, backward):
        assert {spec for spec in BLOCK_MATMULS if any(f"{spec}/" in name for name in names)} == BLOCK_MATMULS, found
    head = [types for types, name in found if HEAD_MATMUL in name]
    assert len(head) == 3 and all(types == ("f32", "f32") for types in head), found  # the head stays in float


def test_fp8_trains_close_to_float32(runs):
    f32, fp8 = runs["none"][1], runs["fp8"][1]
    assert fp8 != f32 and all(map(jax.numpy.isfinite, fp8)), fp8
    assert fp8[-1] < fp8[0] - 0.1, fp8
    assert abs(fp8[-1] / f32[-1] - 1) < 0.03, (fp8, f32)


@pytest.mark.parametrize("precision,message", [
    (PrecisionConfig(compute="float32", quant="fp8"), "precision.quant: fp8 needs a GPU"),
    (PrecisionConfig(compute="float16", quant="int8"), "precision.quant: int8 needs precision.compute float32 or"),
    (PrecisionConfig(compute="float16", quant="fp8"), "precision.quant: fp8 needs precision.compute float32 or"),
    (PrecisionConfig(quant="int4"), "precision.quant: 'int4' is not one of"),
])
def test_bad_quant_is_a_config_error(precision, message):
    from jaxllm.config.schema import check_quant_backend

    with pytest.raises(ConfigError) as info:
        precision.check()
        check_quant_backend(precision)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


GROUPS = (5, 0, 7, 6)  # a mixture's rows grouped by expert, one expert without rows, 2 padding rows after


def _per_expert(matmul, x_PD, kernel_EDF):
    """`matmul(rows, kernel)` on each expert's group of rows (zeros for the padding rows)."""
    ends = np.cumsum(GROUPS)
    parts = [matmul(x_PD[e - n:e], kernel_EDF[i]) for i, (n, e) in enumerate(zip(GROUPS, ends)) if n]
    return jnp.concatenate(parts + [jnp.zeros((x_PD.shape[0] - ends[-1], kernel_EDF.shape[2]))])


def _value_and_grads(matmul, x_PD, kernel_EDF, cotangent_PF):
    return jax.value_and_grad(lambda x, k: jnp.sum(matmul(x, k) * cotangent_PF), argnums=(0, 1))(x_PD, kernel_EDF)


def test_the_experts_quantised_grouped_matmul_is_each_expert_s_quantised_matmul():
    """jaxllm.model.quant.expert_ragged_dot with fp8 (the rounding of a cast, no integer rounding bound) gives,
    forward and both gradients, what qwix's quantised matmul (`weight_einsum`) gives on each expert's rows alone:
    the kernel's scales are per expert, not shared across experts. int8 stays within 2% of float."""
    rng = np.random.default_rng(0)
    x_PD, cotangent_PF = rng.normal(size=(20, 16)).astype(np.float32), rng.normal(size=(20, 8)).astype(np.float32)
    kernel_EDF = (rng.normal(size=(4, 16, 8)) * np.array([1, 3, 10, 0.1])[:, None, None]).astype(np.float32)
    sizes = jnp.asarray(GROUPS, jnp.int32)
    grouped = lambda quant: lambda x, k: expert_ragged_dot(x, k, sizes, quant)
    one_by_one = _value_and_grads(lambda x, k: _per_expert(
        lambda rows, kernel: weight_einsum("PD,DF->PF", rows, kernel, "fp8"), x, k), x_PD, kernel_EDF, cotangent_PF)
    together = _value_and_grads(grouped("fp8"), x_PD, kernel_EDF, cotangent_PF)
    for got, want in zip(jax.tree.leaves(together), jax.tree.leaves(one_by_one)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))))
    exact = _value_and_grads(grouped("none"), x_PD, kernel_EDF, cotangent_PF)
    int8 = _value_and_grads(grouped("int8"), x_PD, kernel_EDF, cotangent_PF)
    for got, want in zip(jax.tree.leaves(int8)[1:], jax.tree.leaves(exact)[1:]):
        assert 0 < np.linalg.norm(got - want) < 0.02 * np.linalg.norm(want)


def test_a_mixture_s_experts_run_int8_dots_forward_and_backward():
    """With `precision.quant=int8` a mixture of experts' three expert projections lower to int8 x int8 dots in the
    forward pass and in both backward dots (jax.lax.ragged_dot on XLA:CPU: one dot over every expert's kernel
    [E, ...]), besides the attention's; none without it."""
    from flax import nnx

    from jaxllm.config.presets import PRESETS
    from jaxllm.model.build import build_model

    model = ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=128))
    tokens = jnp.zeros((2, 16), jnp.int32)

    def int8_dot_operands(quant: str) -> list[list[str]]:
        precision = PrecisionConfig(params="float32", compute="float32", output="float32", quant=quant)
        lm = build_model(model, precision, jax.random.key(0))
        text = jax.jit(nnx.grad(lambda lm: jnp.sum(lm(tokens)))).lower(lm).as_text()
        return [re.findall(r"tensor<([^>]*)>", line)[:2] for line in text.splitlines()
                if "dot_general" in line and "xi8>" in line]

    experts = [ops for ops in int8_dot_operands("int8") if ops[1].startswith(f"{model.num_experts}x")]
    assert len(experts) == 9, experts  # gate, up, down: forward, input gradient, weight gradient
    assert not int8_dot_operands("none")
