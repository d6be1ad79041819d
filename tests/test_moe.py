"""The mixture-of-experts feed-forward (jaxllm/model/moe.py) against transformers 5.25's Mixtral and Qwen3-MoE
sparse blocks on random weights: router logits, top-k choices and weights, outputs and gradients (torch autograd),
the load-balancing loss (with and without padding), and the dropless grouped matmul against every expert run on
every token; Qwen2-MoE's block with its shared expert, outputs and gradients, through the module."""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from jaxllm.model.layers import ACTIVATIONS  # noqa: E402
from jaxllm.model.moe import (MoEMLP, Routing, capacity, capacity_experts, dropless_experts,  # noqa: E402
                              load_balancing_loss, route, router_losses, router_metrics,
                              router_sums, router_z_loss)

D, F, E, K = 32, 24, 6, 2


def _mixtral():
    config = transformers.MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                        num_experts_per_tok=K)
    return modeling_mixtral.MixtralSparseMoeBlock(config), True


def _qwen3_moe(norm_topk_prob: bool):
    config = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                         num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)
    return modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config), norm_topk_prob


BLOCKS = {"mixtral": _mixtral, "qwen3_moe": lambda: _qwen3_moe(False), "qwen3_moe_norm_topk": lambda: _qwen3_moe(True)}


def _randomised(make, seed: int = 0):
    """A transformers sparse MoE block with random weights (its experts are allocated, not initialised) and
    whether its router renormalises the top k."""
    torch.manual_seed(seed)
    block, renormalize = make()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval(), renormalize


def _ours(block):
    """(router [D, E], gate [E, D, F], up [E, D, F], down [E, F, D]) of a transformers block, as numpy."""
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]: gate's rows, then up's
    return (block.gate.weight.detach().numpy().T, gate_up[:, :F].transpose(0, 2, 1), gate_up[:, F:].transpose(0, 2, 1),
            block.experts.down_proj.detach().numpy().transpose(0, 2, 1))


def _moe(x, router, gate, up, down, renormalize):
    routing = route(x, router, K, renormalize)
    return dropless_experts(x, routing, gate, up, down, "silu"), routing


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_routing_and_outputs_match_transformers(name):
    block, renormalize = _randomised(BLOCKS[name])
    x = np.random.default_rng(1).normal(size=(2, 7, D)).astype(np.float32)
    with torch.no_grad():
        theirs = block(torch.tensor(x)).numpy().reshape(14, D)
        logits, weights, experts = (t.numpy() for t in block.gate(torch.tensor(x)))
    out, routing = _moe(jnp.asarray(x.reshape(14, D)), *_ours(block), renormalize)
    np.testing.assert_allclose(routing.logits, logits, atol=1e-5)
    np.testing.assert_array_equal(routing.experts, experts)
    np.testing.assert_allclose(routing.weights, weights, atol=1e-6)
    assert np.allclose(np.asarray(routing.weights).sum(-1), 1.0) == renormalize
    np.testing.assert_allclose(out, theirs, atol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_gradients_match_torch_autograd(name):
    """Gradients of a weighted sum of the outputs, for the input and every weight (the router's through the top-k
    weights), within 1e-4 of each tensor's largest."""
    block, renormalize = _randomised(BLOCKS[name], seed=2)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, D)).astype(np.float32)
    cotangent = rng.normal(size=(9, D)).astype(np.float32)
    x_torch = torch.tensor(x[None], requires_grad=True)
    (block(x_torch)[0] * torch.tensor(cotangent)).sum().backward()
    router_grad = block.gate.weight.grad.numpy().T
    gate_up_grad = block.experts.gate_up_proj.grad.numpy()
    theirs = (x_torch.grad.numpy()[0], router_grad, gate_up_grad[:, :F].transpose(0, 2, 1),
              gate_up_grad[:, F:].transpose(0, 2, 1), block.experts.down_proj.grad.numpy().transpose(0, 2, 1))
    ours = jax.grad(lambda *a: jnp.sum(_moe(*a, renormalize)[0] * cotangent), argnums=(0, 1, 2, 3, 4))(
        jnp.asarray(x), *(jnp.asarray(w) for w in _ours(block)))
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("padded", [False, True])
def test_load_balancing_loss_matches_transformers(padded):
    """transformers' load_balancing_loss_func over two layers' router logits (it takes the softmax once, of the
    logits the router returns), padding masked out or not."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 2 * 5, E)).astype(np.float32) * 2
    mask = np.ones((2, 5), np.int64)
    if padded:
        mask[1, 3:] = 0
    theirs = modeling_mixtral.load_balancing_loss_func(tuple(torch.tensor(layer) for layer in logits), E, K,
                                                       torch.tensor(mask) if padded else None)
    ours = load_balancing_loss(jnp.asarray(logits), K, jnp.asarray(mask.reshape(-1)) if padded else None)
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)
    balanced = load_balancing_loss(jnp.zeros((1, 12, E)), K)  # uniform router: each term (k / E) * (1 / E)
    np.testing.assert_allclose(float(balanced), K, rtol=1e-6)


def test_dropless_groups_equal_every_expert_on_every_token():
    """The ragged grouped matmul equals running all E experts on every token and keeping the routed ones, also
    when some experts get no token at all (their groups are empty)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(11, D)).astype(np.float32))
    shapes = ((E, D, F), (E, D, F), (E, F, D))
    gate, up, down = (jnp.asarray(rng.normal(0, 0.3, size=s).astype(np.float32)) for s in shapes)
    experts = jnp.asarray(rng.choice([0, 2, 3], size=(11, K)).astype(np.int32))  # experts 1, 4, 5 get nothing
    routing = Routing(jnp.zeros((11, E)), experts, jnp.asarray(rng.uniform(size=(11, K)).astype(np.float32)))
    every_TED = jnp.einsum("TEF,EFD->TED", ACTIVATIONS["silu"](jnp.einsum("TD,EDF->TEF", x, gate))
                           * jnp.einsum("TD,EDF->TEF", x, up), down)
    dense = jnp.einsum("TKD,TK->TD", jnp.take_along_axis(every_TED, experts[..., None], axis=1), routing.weights)
    np.testing.assert_allclose(dropless_experts(x, routing, gate, up, down, "silu"), dense, atol=1e-5)


def test_the_module_routes_a_batch_of_rows():
    """MoEMLP holds the router and stacked experts under the logical axes the sharding rules know, and its call on
    [B, T, D] is the functions' on the flattened tokens."""
    with nnx.use_eager_sharding(False):  # as jaxllm.model.build builds models: placement is jaxllm's own
        moe = MoEMLP(D, F, E, K, renormalize=True, activation="silu", init_std=0.3, out_std=0.1, dtype=jnp.float32,
                     rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 3, D)).astype(np.float32))
    out, sums = moe(x)
    want, routing = _moe(x.reshape(6, D), moe.router[...], moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...],
                         True)
    assert out.shape == (2, 3, D) and sums.picks.shape == (2, E) and sums.z.shape == (2,)
    np.testing.assert_allclose(out.reshape(6, D), want, atol=1e-6)
    np.testing.assert_array_equal(sums.picks.sum(-1), [3 * K, 3 * K])  # each row's 3 tokens' K picks
    np.testing.assert_allclose(router_losses(sums, K)[0], load_balancing_loss(routing.logits[None], K), rtol=1e-6)
    np.testing.assert_allclose(router_losses(sums, K)[1], router_z_loss(routing.logits), rtol=1e-6)
    assert moe.gate_proj.get_metadata()["out_sharding"] == ("expert", "embed", "mlp")


def test_qwen2_moe_block_with_its_shared_expert_matches_transformers():
    """MoEMLP with a shared expert against Qwen2-MoE's sparse block: routed experts plus sigmoid(x @ gate) times
    the shared gated MLP. Outputs, and gradients of a weighted sum of them for the input and every weight (the
    shared expert's and its gate's included), within 1e-4 of each tensor's largest."""
    Fs = 20
    config = transformers.Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=F, shared_expert_intermediate_size=Fs,
                                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
    block, _ = _randomised(lambda: (modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config), False), seed=10)
    with nnx.use_eager_sharding(False):
        moe = MoEMLP(D, F, E, K, renormalize=False, activation="silu", init_std=0.3, out_std=0.1,
                     dtype=jnp.float32, rngs=nnx.Rngs(0), shared_mlp_dim=Fs)
    weights = lambda b: (*_ours(b), *(w.detach().numpy().T for w in (
        b.shared_expert.gate_proj.weight, b.shared_expert.up_proj.weight, b.shared_expert.down_proj.weight,
        b.shared_expert_gate.weight)))
    names = ("router", "gate_proj", "up_proj", "down_proj", "shared_gate_proj", "shared_up_proj", "shared_down_proj",
             "shared_expert_gate")
    for name, w in zip(names, weights(block)):
        getattr(moe, name).set_value(jnp.asarray(w))
    assert moe.shared_gate_proj.get_metadata()["out_sharding"] == ("embed", "mlp")
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, 7, D)).astype(np.float32)
    cotangent = rng.normal(size=(2, 7, D)).astype(np.float32)
    x_torch = torch.tensor(x, requires_grad=True)
    theirs = block(x_torch)
    (theirs * torch.tensor(cotangent)).sum().backward()
    np.testing.assert_allclose(moe(jnp.asarray(x))[0], theirs.detach().numpy(), atol=1e-5)
    graphdef, params = nnx.split(moe)

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p)(x)[0] * cotangent)

    grads, x_grad = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x))
    want = dict(zip(names, weights(_Grads(block))))
    np.testing.assert_allclose(x_grad, x_torch.grad.numpy(), atol=1e-4 * np.abs(x_torch.grad.numpy()).max())
    for name in names:
        got = np.asarray(grads[name].get_value())
        np.testing.assert_allclose(got, want[name], atol=1e-4 * np.abs(want[name]).max(), err_msg=name)


class _Grads:
    """A view of a transformers block whose parameters read as their gradients (for `_ours`-style layouts)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if isinstance(value, torch.nn.Parameter):
            return value.grad
        return _Grads(value) if isinstance(value, torch.nn.Module) else value


def _numpy_capacity(x, experts, weights, gate, up, down, capacity):
    """Capacity dispatch written out in numpy: picks visited first choices first, then in token order; an expert
    takes a pick while it has fewer than `capacity`."""
    def silu(a):
        return a / (1 + np.exp(-a))

    out, taken, dropped = np.zeros_like(x), np.zeros(E, int), 0
    for k in range(experts.shape[1]):
        for t in range(x.shape[0]):
            e = experts[t, k]
            if taken[e] == capacity:
                dropped += 1
                continue
            taken[e] += 1
            out[t] += weights[t, k] * ((silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return out, dropped


def test_capacity_dispatch_drops_what_overflows_and_equals_dropless_when_nothing_does():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(13, D)).astype(np.float32)
    gate, up, down = (rng.normal(0, 0.3, size=s).astype(np.float32) for s in ((E, D, F), (E, D, F), (E, F, D)))
    # K different experts a token, as top-k picks are; expert 0 in most tokens' picks, past its capacity
    experts = np.stack([rng.choice([0, 1, 2, 5], size=K, replace=False, p=[0.55, 0.15, 0.15, 0.15])
                        for _ in range(13)]).astype(np.int32)
    weights = rng.uniform(size=(13, K)).astype(np.float32)
    routing = Routing(jnp.zeros((13, E)), jnp.asarray(experts), jnp.asarray(weights))
    args = (jnp.asarray(x), routing, jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down), "silu")
    factor = 1.0
    out, kept = capacity_experts(*args, capacity_factor=factor)
    want, want_dropped = _numpy_capacity(x, experts, weights, gate, up, down, capacity(13, K, E, factor))
    assert int(jnp.sum(~kept)) == want_dropped > 0
    np.testing.assert_allclose(out, want, atol=1e-5)
    whole, kept = capacity_experts(*args, capacity_factor=E / K)  # room for every token in every expert
    assert bool(jnp.all(kept))
    np.testing.assert_allclose(whole, dropless_experts(*args), atol=1e-5)
    def gradients(dispatch):  # of the input and the three expert weights
        loss = lambda a, b, c, d: jnp.sum(dispatch(a, routing, b, c, d, "silu") ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(args[0], *args[2:5])

    full = lambda *a: capacity_experts(*a, capacity_factor=E / K)[0]
    for a, b in zip(gradients(full), gradients(dropless_experts)):
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())


def test_router_z_loss_is_the_mean_squared_logsumexp():
    assert np.isclose(float(router_z_loss(jnp.zeros((5, E)))), np.log(E) ** 2)
    logits = np.random.default_rng(8).normal(size=(4, E)).astype(np.float32)
    want = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(router_z_loss(jnp.asarray(logits))), want, rtol=1e-6)


def test_router_metrics_tell_an_even_router_from_a_collapsed_one():
    """Per layer, from two layers' sums over two rows of 3 tokens each: tokens per expert, their coefficient of
    variation, the router's entropy, and the dropped fraction."""
    routing = lambda logits, experts: Routing(logits, jnp.asarray(experts, np.int32), jnp.ones((6, K)),  # noqa: E731
                                              jax.nn.softmax(logits, axis=-1))
    even = routing(jnp.zeros((6, E)), np.arange(12).reshape(6, K) % E)
    # every token certain of expert 0 (and 1 second)
    collapsed = routing(jnp.full((6, E), -30.0).at[:, 0].set(30.0), np.tile([0, 1], (6, 1)))
    kept = jnp.ones((2, K, 3), bool).at[0, 1].set(False)  # capacity dropped row 0's three second picks
    sums = jax.tree.map(lambda *a: jnp.stack(a), router_sums(even, 2, E), router_sums(collapsed, 2, E, kept))
    stats = {k: np.asarray(v) for k, v in router_metrics(sums, K).items()}
    np.testing.assert_array_equal(stats["expert_tokens_min"], [2, 0])
    np.testing.assert_array_equal(stats["expert_tokens_max"], [2, 6])
    np.testing.assert_allclose(stats["expert_tokens_cv"], [0, np.std([6, 6, 0, 0, 0, 0]) / 2], rtol=1e-6)
    np.testing.assert_allclose(stats["router_entropy"], [np.log(E), 0], atol=1e-6)  # uniform, then certain
    np.testing.assert_allclose(stats["moe_dropped_fraction"], [0, 3 / 12])
    np.testing.assert_allclose(stats["expert_top_share"], [4 / 12, 1])  # K busiest: 2 + 2 of 12, then all


def test_expert_windows_add_up_to_all_experts_and_capacity_is_per_row():
    """Expert parallelism's per-device part (jaxllm/parallel/experts.py): each device's window of the experts adds
    its experts' share, and the windows add up to every expert's outputs, dropless and capacity. Capacity counts
    within each row: two rows dispatched together equal each row alone."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(2 * 7, D)).astype(np.float32))
    weights = [jnp.asarray(rng.normal(0, 0.3, size=s).astype(np.float32)) for s in ((E, D, F), (E, D, F), (E, F, D))]
    routing = route(x, jnp.asarray(rng.normal(size=(D, E)).astype(np.float32)), K, True)
    dispatches = {"dropless": lambda r, w, **kw: dropless_experts(r[0], r[1], *w, "silu", **kw),
                  "capacity": lambda r, w, **kw: capacity_experts(r[0], r[1], *w, "silu", 0.75, rows=len(r[0]) // 7,
                                                                  **kw)[0]}
    for name, dispatch in dispatches.items():
        whole = dispatch((x, routing), weights)
        windows = sum(dispatch((x, routing), [w[first:first + 2] for w in weights], first_expert=first,
                               num_experts=E) for first in range(0, E, 2))
        np.testing.assert_allclose(windows, whole, atol=1e-5, err_msg=name)
    rows = [capacity_experts(x[r * 7:(r + 1) * 7], Routing(None, routing.experts[r * 7:(r + 1) * 7],
                                                           routing.weights[r * 7:(r + 1) * 7]), *weights, "silu", 0.75)
            for r in range(2)]
    together, kept = capacity_experts(x, routing, *weights, "silu", 0.75, rows=2)
    np.testing.assert_allclose(together, jnp.concatenate([out for out, _ in rows]), atol=1e-6)
    np.testing.assert_array_equal(kept, jnp.concatenate([k for _, k in rows]))
    assert not bool(jnp.all(kept))  # a factor of 0.75 drops some picks


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_routing_with_a_bias_matches_deepseek_v3(renormalize):
    """Sigmoid scores chosen by score + bias and weighted by the score alone: transformers 5.25's DeepseekV3
    router with one expert group (no group-limited routing) and a routed scaling factor of 1."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    config = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=1,
                                           topk_group=1, norm_topk_prob=renormalize, routed_scaling_factor=1.0)
    router = modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    rng = np.random.default_rng(3)
    kernel, bias = rng.normal(size=(E, D)).astype(np.float32) * 0.3, rng.normal(size=E).astype(np.float32) * 0.2
    x = rng.normal(size=(14, D)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(kernel))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
        logits, weights, experts = (t.numpy() for t in router(torch.tensor(x)))
    routing = route(jnp.asarray(x), jnp.asarray(kernel.T), K, renormalize, "sigmoid", jnp.asarray(bias))
    np.testing.assert_allclose(routing.logits, logits, atol=1e-5)
    order, ours = np.argsort(experts, axis=-1), np.argsort(np.asarray(routing.experts), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(routing.experts), ours, -1),
                                  np.take_along_axis(experts, order, -1))  # torch's top k is unsorted here
    np.testing.assert_allclose(np.take_along_axis(np.asarray(routing.weights), ours, -1),
                               np.take_along_axis(weights, order, -1), atol=1e-6)
    chosen_without_bias = np.asarray(route(jnp.asarray(x), jnp.asarray(kernel.T), K, renormalize, "sigmoid").experts)
    assert np.any(np.sort(chosen_without_bias, -1) != np.sort(np.asarray(routing.experts), -1))  # the bias chose
