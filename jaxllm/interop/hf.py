"""Hugging Face checkpoints of the families jaxllm builds (jaxllm/config/families/: Llama, Qwen2, Qwen3,
Mistral, Gemma 3, Mixtral, Qwen2-MoE, Qwen3-MoE) <-> jaxllm `Transformer`, through one declarative table; reward
models <-> the family's `*ForSequenceClassification` (num_labels=1) through the same table with its `score` head
for the lm_head.

`table(cfg)` has one row per tensor kind: the Hugging Face name (with `{i}` for the layer), the jaxllm parameter
path, and the layout transform between them; a family's blocks add their rows (q/k/v biases, q/k norms). Import
reads it forwards, export backwards. Weights are read with `safetensors` in numpy mode (no torch needed);
`ml_dtypes` registers bfloat16 with numpy so bf16 files load.

With a mesh, every parameter is created directly in its shards (`jax.make_array_from_callback`), each shard
reading only its own slice of each layer's tensor from disk, so no process holds a whole large tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors' numpy mode then reads bf16)
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxllm.config.families import FAMILIES, family_of_model_type
from jaxllm.config.families.blocks import Family, FamilyConfigError
from jaxllm.config.schema import ModelConfig, PrecisionConfig
from jaxllm.model.rope import ROPE_TYPE_FIELDS, RopeScaling
from jaxllm.model.reward import RewardModel
from jaxllm.model.transformer import Transformer
from jaxllm.interop import hf_peft
from jaxllm.interop.table import (FUSED_DOWN, FUSED_GATE, FUSED_UP, IDENTITY, SPLIT_HEADS, SPLIT_IN_HEADS,
                                  SPLIT_OUT_HEADS, TRANSPOSE, Row)
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.model.lora import merge

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


TABLE: tuple[Row, ...] = (
    Row("model.embed_tokens.weight", ("embed_tokens", "embedding"), IDENTITY),
    Row("model.layers.{i}.self_attn.q_proj.weight", ("layers", "self_attn", "q_proj"), SPLIT_OUT_HEADS),
    Row("model.layers.{i}.self_attn.k_proj.weight", ("layers", "self_attn", "k_proj"), SPLIT_OUT_HEADS),
    Row("model.layers.{i}.self_attn.v_proj.weight", ("layers", "self_attn", "v_proj"), SPLIT_OUT_HEADS),
    Row("model.layers.{i}.self_attn.o_proj.weight", ("layers", "self_attn", "o_proj"), SPLIT_IN_HEADS),
    Row("model.layers.{i}.mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), TRANSPOSE),
    Row("model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "up_proj"), TRANSPOSE),
    Row("model.layers.{i}.mlp.down_proj.weight", ("layers", "mlp", "down_proj"), TRANSPOSE),
    Row("model.layers.{i}.input_layernorm.weight", ("layers", "input_layernorm", "scale"), IDENTITY),
    Row("model.layers.{i}.post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"),
        IDENTITY),
    Row("model.norm.weight", ("norm", "scale"), IDENTITY),
    Row("lm_head.weight", ("lm_head",), TRANSPOSE),  # absent from the model (and file) when tied
)
# The rows a family's blocks (jaxllm.config.families.blocks.Blocks) add, by block.
BLOCK_ROWS: dict[str, tuple[Row, ...]] = {
    "qkv_bias": tuple(Row(f"model.layers.{{i}}.self_attn.{p}_proj.bias", ("layers", "self_attn", f"{p}_bias"),
                          SPLIT_HEADS) for p in "qkv"),
    "qk_norm": tuple(Row(f"model.layers.{{i}}.self_attn.{p}_norm.weight", ("layers", "self_attn", f"{p}_norm", "scale"),
                         IDENTITY) for p in "qk"),
    "sandwich_norms": tuple(Row(f"model.layers.{{i}}.{name}.weight", ("layers", name, "scale"), IDENTITY)
                            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm")),
}
# A mixture of experts' rows in place of the MLP's, by the family's naming (Blocks.experts), as transformers'
# save_pretrained writes them: the router, and each expert's three projections ({e}).
_MOE = ("router", "gate_proj", "up_proj", "down_proj")
EXPERT_ROWS: dict[str, tuple[Row, ...]] = {
    naming: tuple(Row(f"model.layers.{{i}}.{prefix}.{name}.weight", ("layers", "mlp", param), TRANSPOSE)
                  for name, param in zip(("gate",) + tuple(f"experts.{{e}}.{p}" for p in projections), _MOE))
    for naming, prefix, projections in (("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
                                        ("qwen_moe", "mlp", ("gate_proj", "up_proj", "down_proj")))
}
# A shared expert's rows (Blocks.shared_expert: Qwen2-MoE), beside the routed experts': a dense MLP's three
# projections and its gate [1, D] <-> [D, 1].
SHARED_EXPERT_ROWS: tuple[Row, ...] = tuple(
    Row(f"model.layers.{{i}}.mlp.{name}.weight", ("layers", "mlp", param), TRANSPOSE)
    for name, param in (("shared_expert.gate_proj", "shared_gate_proj"), ("shared_expert.up_proj", "shared_up_proj"),
                        ("shared_expert.down_proj", "shared_down_proj"), ("shared_expert_gate", "shared_expert_gate")))
# The same, fused as transformers 5 holds them in memory (any family): read when a file has them.
FUSED_EXPERT_ROWS: tuple[Row, ...] = tuple(
    Row(f"model.layers.{{i}}.mlp.{name}", ("layers", "mlp", param), transform)
    for name, param, transform in zip(("gate.weight", "experts.gate_up_proj", "experts.gate_up_proj",
                                       "experts.down_proj"), _MOE, (TRANSPOSE, FUSED_GATE, FUSED_UP, FUSED_DOWN)))
_DENSE_MLP = tuple(f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
# A reward model (jaxllm.model.reward.RewardModel): the same body, `score` [D, 1] <-> HF score.weight [1, D].
SCORE_ROW = Row("score.weight", ("score",), TRANSPOSE)


def table(cfg: ModelConfig, reward: bool = False) -> tuple[Row, ...]:
    """The rows of a model of `cfg`: the shared ones, its blocks' and its head (the score head of a reward model)."""
    blocks = dataclasses.asdict(cfg.blocks)
    extra = tuple(row for block, rows in BLOCK_ROWS.items() if blocks[block] for row in rows)
    body = TABLE[:-1]
    if cfg.blocks.experts:
        body = tuple(row for row in body if row.hf not in _DENSE_MLP) + EXPERT_ROWS[cfg.blocks.experts]
    if cfg.blocks.shared_expert:
        body += SHARED_EXPERT_ROWS
    return body + extra + (SCORE_ROW if reward else TABLE[-1],)


def _rows_in_file(rows: tuple[Row, ...], weights: "_Weights") -> tuple[Row, ...]:
    """`rows` with the experts' read fused where the file holds them so (layer 0's gate_up_proj)."""
    if not any(row.lead_keys == ("i", "e") for row in rows) or not weights.has(FUSED_EXPERT_ROWS[1].hf.format(i=0)):
        return rows
    experts = {row.path for row in FUSED_EXPERT_ROWS}
    return tuple(row for row in rows if row.path not in experts) + FUSED_EXPERT_ROWS


def _table(model) -> tuple[Row, ...]:
    return table(model.cfg, isinstance(model, RewardModel))


def family_of(hf: dict) -> Family:
    """The family a config.json describes; ValueError naming its architecture when jaxllm has none."""
    model_type = hf.get("model_type", "llama")
    family = family_of_model_type(model_type)
    architecture = (hf.get("architectures") or [family.causal_lm if family else model_type])[0]
    if family is None or architecture not in (family.causal_lm, family.sequence_classification):
        known = ", ".join(name for f in FAMILIES.values() for name in (f.causal_lm, f.sequence_classification) if name)
        raise ValueError(f"{CONFIG_FILE}: unsupported architecture {architecture!r} (model_type {model_type!r}); "
                         f"supported: {known}")
    return family


def is_reward_config(hf: dict) -> bool:
    """Whether a config.json describes a sequence-classification (reward) model."""
    return (hf.get("architectures") or [""])[0] == family_of(hf).sequence_classification


# ----------------------------------------------------------------------------------------------- config


def _rope_parameters(hf: dict) -> dict:
    """transformers 5 keeps rope_theta and scaling in `rope_parameters`; older files in top-level keys."""
    params = dict(hf.get("rope_scaling") or {})
    rope = hf.get("rope_parameters") or {}
    params.update(rope.get("full_attention", rope))  # Gemma 3 keys its parameters by layer type: the global ones
    if "rope_theta" not in params and "rope_theta" in hf:
        params["rope_theta"] = hf["rope_theta"]
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def config_from_hf(hf: dict) -> ModelConfig:
    """A jaxllm ModelConfig from a Hugging Face `config.json` dict of a family jaxllm builds (a causal LM or its
    sequence-classification model): the shapes every family shares, then the family's own keys."""
    family = family_of(hf)
    if family.blocks.activation == "silu" and hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{CONFIG_FILE}: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    try:
        own = family.from_hf(hf)
    except FamilyConfigError as exc:
        raise ValueError(f"{CONFIG_FILE}: {exc}") from None
    heads = hf["num_attention_heads"]
    shared = dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"],
        rope_theta=float(_rope_parameters(hf).get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        family=family.name,
    )
    return ModelConfig(**{**shared, **own})


def rope_scaling_from_hf(hf: dict) -> RopeScaling | None:
    """The RoPE rescaling a config asks for (`rope_type`, or the older `type`); None for plain RoPE. Unsupported
    kinds raise NotImplementedError. What a config leaves out is filled in as transformers fills it: the original
    context of llama3 and yarn from `max_position_embeddings`, yarn's factor from the two's ratio."""
    params = _rope_parameters(hf)
    kind = params.get("rope_type", "default")
    if kind == "default":
        return None
    if kind not in ROPE_TYPE_FIELDS:
        raise NotImplementedError(f"{CONFIG_FILE}: rope_parameters.rope_type={kind!r} is not supported "
                                  f"(only {['default', *ROPE_TYPE_FIELDS]})")
    if kind != "linear":  # a top-level original_max_position_embeddings wins, as in transformers (Phi-3's)
        params["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings")
                                                      or params.get("original_max_position_embeddings")
                                                      or hf.get("max_position_embeddings"))
    if kind == "yarn" and params.get("factor") is None:
        params["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
    return RopeScaling(rope_type=kind, **{k: params[k] for k in ROPE_TYPE_FIELDS[kind] if params.get(k) is not None})


def _max_positions(rope_scaling: RopeScaling | None) -> int:
    """The config's max_position_embeddings: YaRN's extended context (transformers checks it against the factor),
    else 8192."""
    if rope_scaling is None or rope_scaling.rope_type != "yarn":
        return 8192
    return int(rope_scaling.original_max_position_embeddings * rope_scaling.factor)


def config_to_hf(cfg: ModelConfig, rope_scaling: RopeScaling | None = None, dtype: str = "float32",
                 reward_pad_id: int | None = None, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict:
    """A `config.json` dict of `cfg`'s family's causal LM (readable by transformers 4.x and 5.x); with
    `reward_pad_id`, of its sequence-classification model (one label) whose pad token is that id (it finds each
    sequence's last non-padding token by it). `rope_scaling` None: the config's own (`model.rope_scaling`).

    The token ids given are recorded (`reward_pad_id` wins over `pad_token_id`): transformers builds a model's
    generation config from them when there is no generation_config.json, so `generate` stops at that EOS (left
    out, the family's defaults apply, e.g. Llama's eos 2)."""
    family = FAMILIES[cfg.family]
    rope_scaling = rope_scaling or RopeScaling.from_model_config(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if rope_scaling is not None:
        rope.update(rope_type=rope_scaling.rope_type, **rope_scaling.parameters())
    token_ids = {f"{kind}_token_id": i for kind, i in (("bos", bos_token_id), ("eos", eos_token_id),
                                                        ("pad", pad_token_id)) if i is not None}
    reward = {} if reward_pad_id is None else {"architectures": [family.sequence_classification], "num_labels": 1,
                                                 "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
                                                 "pad_token_id": reward_pad_id}
    return {
        "architectures": [family.causal_lm],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        **({"hidden_act": "silu"} if cfg.blocks.activation == "silu" else {}),
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x reads these two; 5.x reads rope_parameters
        "rope_scaling": None if rope_scaling is None else rope,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": _max_positions(rope_scaling),
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
        **family.to_hf(dataclasses.asdict(cfg), rope),
        **token_ids,
        **reward,
    }


# ----------------------------------------------------------------------------------------------- reading


class _Weights:
    """Tensor name -> file lookup over a single or index-sharded safetensors checkpoint; files opened lazily."""

    def __init__(self, path: Path, weights_file: str = WEIGHTS_FILE):
        if (path / INDEX_FILE).is_file() and weights_file == WEIGHTS_FILE:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            self.files = {name: path / file for name, file in weight_map.items()}
            for file in set(self.files.values()):
                if not file.is_file():
                    raise FileNotFoundError(f"{file}: listed in {path / INDEX_FILE} but missing")
        elif (path / weights_file).is_file():
            with safe_open(path / weights_file, framework="np") as f:
                self.files = {name: path / weights_file for name in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: no {weights_file} or {INDEX_FILE} (only safetensors are supported)")
        self._open: dict[Path, object] = {}

    def _handle(self, name: str):
        if name not in self.files:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="np")
        return self._open[file]

    def has(self, name: str) -> bool:
        return name in self.files

    def check_shape(self, name: str, expected: tuple) -> None:
        found = tuple(self._handle(name).get_slice(name).get_shape())
        if found != tuple(expected):
            raise ValueError(f"{self.files[name]}: tensor {name!r} has shape {list(found)}, "
                             f"expected {list(expected)} for this config.json")

    def read(self, name: str, slices: tuple) -> np.ndarray:
        """Only the given slice of tensor `name` is read from disk."""
        return self._handle(name).get_slice(name)[slices]


def _full_slices(index, shape) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def _tensor_names(row: Row, shape: tuple, first_layer: int = 0) -> dict[tuple, str]:
    """The HF tensor name of each index of the row's leading axes (layer, expert) in a parameter of `shape` whose
    layers start at `first_layer`."""
    keys = row.lead_keys
    names = {}
    for at in itertools.product(*map(range, shape[:len(keys)])):
        index = dict(zip(keys, at))
        if "i" in index:
            index["i"] += first_layer
        names[at] = row.hf.format(**index)
    return names


def _load_param(weights: _Weights, row: Row, shape: tuple, dtype, sharding, first_layer: int = 0) -> jax.Array:
    """Parameter `row` of global `shape` placed by `sharding`, each shard reading just its slice (a stacked
    parameter's layers from `first_layer` on: `shape[0]` of them)."""
    lead = len(row.lead_keys)
    tensor_shape = shape[lead:]  # one HF tensor's part: a layer's, or a layer's expert's
    names = _tensor_names(row, shape, first_layer)
    for name in names.values():
        weights.check_shape(name, row.transform.hf_shape(tensor_shape))

    def read_tensor(name, sl):
        part = weights.read(name, row.transform.hf_slices(sl, tensor_shape))
        return np.asarray(row.transform.to_jax(part, sl, tensor_shape)).astype(dtype)

    def read(at: tuple, index: tuple) -> np.ndarray:
        """The block at leading indices `at` (then the rest of `index`'s leading slices), stacked."""
        if len(at) == lead:
            return read_tensor(names[at], index)
        return np.stack([read(at + (j,), index[1:]) for j in range(*index[0].indices(shape[len(at)]))])

    return jax.make_array_from_callback(shape, sharding, lambda index: read((), _full_slices(index, shape)))


def _get(state, path):
    for key in path:
        state = state[key]
    return state


def _unwrap(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def from_pretrained(path, mesh: jax.sharding.Mesh | None = None, dtype: str = "float32",
                    adapter=None) -> Transformer:
    """Load a Hugging Face directory (config.json + safetensors) of a family jaxllm builds (LlamaForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Gemma3ForCausalLM) as a jaxllm Transformer (the family's
    *ForSequenceClassification with one label as a jaxllm.model.reward.RewardModel).

    Parameters are stored and computed in `dtype` (logits in float32). With `mesh`, parameters are sharded
    per `jaxllm.parallel.sharding.RULES` and loaded shard by shard; without, they are plain single-device arrays.
    `adapter`: a PEFT LoRA adapter directory applied to this base (the model then carries the adapters).
    """
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path / CONFIG_FILE}: not found (expected a Hugging Face model directory)")
    hf_cfg = json.loads((path / CONFIG_FILE).read_text())
    cfg = config_from_hf(hf_cfg)
    scaling = rope_scaling_from_hf(hf_cfg)
    precision = PrecisionConfig(params=dtype, compute=dtype, output="float32")
    lora = hf_peft.read_config(Path(adapter)) if adapter is not None else None
    reward = is_reward_config(hf_cfg)
    if reward and hf_cfg.get("num_labels", len(hf_cfg.get("id2label") or {0: 0})) != 1:
        raise ValueError(f"{path / CONFIG_FILE}: a sequence-classification model with more than one label is not a "
                         "reward model")
    model_class = RewardModel if reward else Transformer
    sources = [(_Weights(path), table(cfg, reward))]
    if lora is not None:
        sources.append((_Weights(Path(adapter), hf_peft.WEIGHTS_FILE), hf_peft.adapter_rows(lora.target_list)))

    def build():
        with nnx.use_eager_sharding(False):
            return nnx.split(model_class(cfg, precision, rngs=nnx.Rngs(params=0), rope_scaling=scaling, lora=lora))

    graphdef, abstract = jax.eval_shape(build)
    if mesh is not None:
        shardings = sharding_tree(abstract, mesh)
    else:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: single, abstract)
    for weights, rows in sources:
        for row in _rows_in_file(rows, weights):
            if row.path == ("lm_head",) and cfg.tie_embeddings:
                continue  # tied: the embedding is the head; a stray lm_head.weight in the file is ignored
            var, sharding = _get(abstract, row.path), _unwrap(_get(shardings, row.path))
            value = var.get_value()
            loaded = _load_param(weights, row, tuple(value.shape), value.dtype, sharding)
            var.set_value(loaded)
    return nnx.merge(graphdef, abstract)


def load_params(path, abstract: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
    """The parameters `abstract` names (ShapeDtypeStructs in nnx variables keyed as the family's jaxllm model's:
    all of its parameters, or a part) from the Hugging Face directory `path`, each in its dtype and created in
    its shards per the sharding rules on `mesh`: only what `abstract` names is read from disk."""
    return param_reader(path, abstract, mesh)(0)


def param_reader(path, abstract: nnx.State, mesh: jax.sharding.Mesh):
    """`read(first_layer)`: `load_params` of `abstract` whose stacked parameters are a run of layers from
    `first_layer` on (their leading dimension says how many), with the directory's config, index and files opened
    once for every read (a base quantised layer by layer reads each kernel's layers in turn)."""
    path = Path(path)
    hf_cfg = json.loads((path / CONFIG_FILE).read_text())
    weights = _Weights(path)
    rows = {row.path: row for row in _rows_in_file(table(config_from_hf(hf_cfg), is_reward_config(hf_cfg)), weights)}
    shardings = dict(nnx.to_flat_state(sharding_tree(abstract, mesh)))
    for at in shardings:
        if at not in rows:
            raise ValueError(f"{path}: no tensor of this family holds the parameter {'/'.join(map(str, at))}")

    def read(first_layer: int) -> nnx.State:
        loaded = []
        for at, var in nnx.to_flat_state(abstract):
            value = var.get_value()
            array = _load_param(weights, rows[at], tuple(value.shape), value.dtype, _unwrap(shardings[at]),
                                first_layer if rows[at].stacked else 0)
            loaded.append((at, var.replace(array)))
        return nnx.from_flat_state(loaded)

    return read


# ----------------------------------------------------------------------------------------------- writing


def _hf_tensors(model: Transformer, rows):
    """(HF name, numpy array) for every tensor, one layer at a time (a sharded array is gathered per layer)."""
    state = nnx.state(model)
    for row in rows:
        if row.path == ("lm_head",) and model.cfg.tie_embeddings:
            continue
        value = _get(state, row.path).get_value()
        if row.stacked:
            for i in range(value.shape[0]):
                layer = np.asarray(value[i])  # one gather of a sharded array per layer
                for e in range(layer.shape[0]) if "e" in row.lead_keys else [None]:
                    tensor = layer if e is None else layer[e]
                    yield row.hf.format(i=i, e=e), np.ascontiguousarray(row.transform.to_hf(tensor))
        else:
            yield row.hf, np.ascontiguousarray(row.transform.to_hf(np.asarray(value)))


def _check_routing_exports(cfg: ModelConfig) -> None:
    """A ValueError when `cfg`'s router has no counterpart in its family's transformers model: Mixtral and the
    Qwens route by a softmax and hold no routing bias (nothing is written)."""
    if cfg.num_experts and (cfg.moe_router_scores != "softmax" or cfg.moe_bias_update_rate):
        raise ValueError(f"model.moe_router_scores={cfg.moe_router_scores!r} with model.moe_bias_update_rate="
                         f"{cfg.moe_bias_update_rate}: family {cfg.family!r}'s transformers model routes by a softmax "
                         "without a routing bias, so this router cannot be exported")


def save_pretrained(model: Transformer, path, *, max_shard_bytes: int | None = None, adapter_only: bool = False,
                    base_model: str = "", pad_token_id: int = 0, bos_token_id: int | None = None,
                    eos_token_id: int | None = None) -> None:
    """Write `model` as a Hugging Face directory of its family's causal LM (LlamaForCausalLM, Qwen2ForCausalLM,
    ...) loadable by `AutoModelForCausalLM` (a reward model as the family's *ForSequenceClassification with
    `pad_token_id`, loadable by `AutoModelForSequenceClassification`).

    With `bos_token_id` / `eos_token_id` (the run's tokenizer's), config.json records them and `pad_token_id`, so
    that `generate` stops at the run's EOS (a negative id, a sentencepiece model without that token, is left
    out); without, a causal LM's config names no token ids (its family's defaults apply).

    Tensors keep the model's parameter dtype. Above `max_shard_bytes` the weights are split over
    `model-0000k-of-0000n.safetensors` files with a `model.safetensors.index.json`. A model with LoRA adapters
    is written merged (W + scale * A @ B); with `adapter_only` only its adapters are written, in PEFT's format
    (loadable by `peft.PeftModel.from_pretrained` on the base; `base_model` goes into its config).
    """
    path = Path(path)
    if adapter_only:
        if model.lora is None:
            raise ValueError("adapter_only=True: the model has no LoRA adapters")
        path.mkdir(parents=True, exist_ok=True)
        config = hf_peft.config_json(model.lora, base_model)
        (path / hf_peft.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        tensors = dict(_hf_tensors(model, hf_peft.adapter_rows(model.lora.target_list)))
        save_file(tensors, path / hf_peft.WEIGHTS_FILE, metadata={"format": "pt"})
        return
    _check_routing_exports(model.cfg)
    model = merge(model)
    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(_hf_tensors(model, _table(model)))
    dtype = str(np.dtype(next(iter(tensors.values())).dtype))
    tokens = {} if bos_token_id is None and eos_token_id is None else {
        key: i for key, i in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id),
                              ("pad_token_id", pad_token_id)) if i is not None and i >= 0}
    config = config_to_hf(model.cfg, getattr(model, "rope_scaling", None), dtype,
                          pad_token_id if isinstance(model, RewardModel) else None, **tokens)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, path / WEIGHTS_FILE, metadata=metadata)
        return
    shards: list[dict] = [{}]
    for name, tensor in tensors.items():  # greedy packing in table order; a tensor never spans two files
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata=metadata)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

