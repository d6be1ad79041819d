"""A trained run on disk as a model: `load_checkpoint` (a jaxllm checkpoint as a standalone model, for export,
generation, evaluation and RL's reward models) and `load_base` (the parameters of a fine-tuning run's base, placed
on its mesh).

The model config is read from the checkpoint's metadata and only the parameters are restored (never the
optimizer state), so they work on any run's checkpoint whatever its optimizer or mesh. The model is built through
`jaxllm.model.build`: the language model, or the reward model (`jaxllm.model.reward.RewardModel`) for a reward
run, with the run's adapters when its checkpoints hold them; never through an objective. Which model, and which of
its parameters come from the run's base, the checkpoint's own arrays say: so every objective's checkpoint loads
(an actor-critic's as its policy), whatever objective wrote it.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config.schema import LoRAConfig, ModelConfig, PrecisionConfig
from jaxllm.data.tokenizer import find_tokenizer_file
from jaxllm.interop import hf
from jaxllm.model.base_quant import as_float, float_kernel, quantize_kernel, quantized_kernels
from jaxllm.model.build import build_model
from jaxllm.model.lora import merge
from jaxllm.model.reward import RewardModel
from jaxllm.model.transformer import Transformer
from jaxllm.parallel.mesh import single_device_mesh
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.runs import base_model
from jaxllm.runs.checkpoint import CheckpointError, Checkpointer, array_shapes, locate_checkpoints


def _fields(cls, values: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in (values or {}).items() if k in names}


@dataclasses.dataclass
class LoadedCheckpoint:
    graphdef: Any
    params: Any
    model_cfg: ModelConfig
    precision: PrecisionConfig
    config: dict  # the checkpoint's recorded run config (meta["config"])
    meta: dict
    path: Path  # the step directory

    @property
    def model(self):
        return nnx.merge(self.graphdef, self.params)

    def tokenizer_path(self) -> Path | None:
        """The tokenizer recorded with the checkpoint: meta `tokenizer`, else the tokenizer.json or tokenizer.model
        of the training data store (`data.path`)."""
        candidates = []
        if self.meta.get("tokenizer"):
            candidates.append(Path(self.meta["tokenizer"]))
        data_path = (self.config.get("data") or {}).get("path")
        if data_path:
            candidates.append(find_tokenizer_file(data_path))
        return next((c for c in candidates if c is not None and c.is_file()), None)


def _saved_model(config: dict, model_cfg, precision, saved: set[str], rope_scaling=None):
    """(graphdef, abstract parameters) of the model whose parameters a checkpoint holds, as its arrays tell
    (`saved`: their names): the reward model when they hold its score head, else the language model (an
    actor-critic's policy: its critic is left out), with the run's adapters when they hold LoRA ones."""
    reward = any(name.startswith("params/score/") for name in saved)
    lora = LoRAConfig(**_fields(LoRAConfig, config.get("lora"))) if base_model.holds_adapters(saved) else None
    return jax.eval_shape(lambda: nnx.split(build_model(model_cfg, precision, jax.random.key(0), lora=lora,
                                                        rope_scaling=rope_scaling,
                                                        model_class=RewardModel if reward else Transformer)))


def _split_by_name(abstract, saved: set[str]):
    """(the variables of `abstract` whose arrays are among `saved`, the others)."""
    flat = nnx.to_flat_state(abstract)
    held = [array_name(path, variable) in saved for path, variable in flat]
    return (nnx.from_flat_state([item for item, h in zip(flat, held) if h]),
            nnx.from_flat_state([item for item, h in zip(flat, held) if not h]))


def array_name(path: tuple, variable) -> str:
    """The name a checkpoint gives the parameter at nnx `path` (`jaxllm.runs.checkpoint.array_shapes`)."""
    return next(iter(array_shapes({"params": nnx.from_flat_state([(path, variable)])})))


def _load_on_base(source: Checkpointer, step: int, meta: dict, model_cfg, precision, saved: set[str], mesh):
    """(graphdef, params) of a checkpoint that holds part of its model (adapters, a new head): that part on the
    base model its metadata records (loaded again, and checked against the recorded fingerprint)."""
    record = meta.get("base") or {}
    if not record.get("path"):
        raise CheckpointError(f"{source.directory / str(step)}: adapters of a run with no base model recorded")
    base = base_model.locate(record["path"])
    graphdef, abstract = _saved_model(meta["config"], model_cfg, precision, saved, base.rope_scaling)
    held, lacking = _split_by_name(abstract, saved)
    adapters = source.restore_params(step, held, mesh)
    frozen, identity = load_base(base, lacking, mesh)
    base_model.check_same_base(base_model.accepted(record, identity, frozen), base.record(identity))
    return graphdef, nnx.merge_state(adapters, frozen)


def load_checkpoint(path: str, step: int | None = None, mesh=None, compute: str | None = None) -> LoadedCheckpoint:
    """A checkpoint (run workdir, checkpoints directory or one step directory) as graphdef + params.

    A LoRA fine-tuning run's checkpoint holds adapters only: they are loaded onto the base model it records (the
    model then carries the adapters; `jaxllm.model.lora.merge` or `hf.save_pretrained` give the merged one). A reward
    model run gives a jaxllm.model.reward.RewardModel.
    Computation runs in the parameter dtype unless `compute` is given; logits are float32.
    """
    mesh = single_device_mesh() if mesh is None else mesh
    directory, located = locate_checkpoints(path)
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    step = located if step is None else step
    source = Checkpointer(directory, keep=1000, log=lambda *_: None)
    try:
        step = source.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no committed checkpoint in {directory}")
        if step not in source.steps():
            raise CheckpointError(f"no committed checkpoint step {step} in {directory} (have {source.steps()})")
        meta = source.read_meta(step)
        config = meta.get("config") or {}
        if "model" not in config:
            raise CheckpointError(f"{directory / str(step)}: its metadata records no model config")
        model_cfg = ModelConfig(**_fields(ModelConfig, config["model"]))
        stored = PrecisionConfig(**_fields(PrecisionConfig, config.get("precision", {})))
        precision = PrecisionConfig(params=stored.params, compute=compute or stored.params, output="float32")
        saved = source.saved_param_names(step)
        with jax.set_mesh(mesh):
            if base_model.holds_adapters(saved):  # adapters (and a new head): the rest is the base's
                graphdef, params = _load_on_base(source, step, meta, model_cfg, precision, saved, mesh)
            else:
                graphdef, abstract = _saved_model(config, model_cfg, precision, saved)
                params = source.restore_params(step, abstract, mesh)
    finally:
        source.close()
    return LoadedCheckpoint(graphdef, params, model_cfg, precision, config, meta, Path(directory) / str(step))


def load_base(base: base_model.Base, abstract, mesh):
    """(the parameters of `base` as the tree `abstract` (ShapeDtypeStructs of nnx.Param variables: the plain
    model's, or part of them; a QLoRA model's quantised kernels among them), placed per the sharding rules on
    `mesh`; the base's fingerprint).

    The fingerprint is of the arrays as stored: a LoRA run's base is its adapters and its own base's arrays, not
    their merge, whose last bits follow the compiler (its optimisation level, CPU or GPU) rather than the base.
    A quantised base's fingerprint is its float arrays', the same as a plain LoRA run's on that base."""
    if quantized_kernels(abstract):
        return _load_quantized(base, abstract, mesh)
    if base.kind == "jaxllm-lora":
        merged, identity = _merged_lora_base(base, abstract, mesh)
        return _placed_like(merged, abstract, mesh), identity
    params = _restore_float(base, abstract, mesh)
    return params, base_model.fingerprint(params)


def _restore_float(base: base_model.Base, abstract, mesh, verify: bool = True):
    """The float parameters `abstract` names from a jaxllm checkpoint or a Hugging Face directory, placed."""
    if base.kind == "jaxllm":
        source = Checkpointer(base.path.parent, keep=1000, log=lambda *_: None)
        try:
            return source.restore_params(base.step, abstract, mesh, verify=verify)
        finally:
            source.close()
    return hf.load_params(base.path, abstract, mesh)


def _merged_lora_base(base: base_model.Base, abstract, mesh):
    """(the merged float model of a LoRA run's checkpoint (all its parameters, unplaced), its fingerprint)."""
    dtype = jnp.dtype(next(leaf.dtype for leaf in jax.tree.leaves(abstract)
                           if jnp.issubdtype(leaf.dtype, jnp.floating))).name
    loaded = load_checkpoint(str(base.path), mesh=mesh, compute=dtype)
    return nnx.state(merge(loaded.model), nnx.Param), base_model.fingerprint(loaded.params)


def _load_quantized(base: base_model.Base, abstract, mesh):
    """`load_base` of a tree with quantised kernels. The rest of the base loads first, then each kernel: from a
    Hugging Face directory one layer at a time, read, quantised on the devices and written into its place in the
    quantised stack, so the float base never exists whole, nor one float kernel of every layer; from a jaxllm
    checkpoint one kernel (all its layers) at a time; a LoRA run's base is merged whole first."""
    kernels = quantized_kernels(abstract)
    floats = as_float(abstract)
    rest = nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(floats) if p not in kernels])
    merged, identity = _merged_lora_base(base, floats, mesh) if base.kind == "jaxllm-lora" else (None, None)

    def read(part, verify=False):
        return _placed_like(merged, part, mesh) if merged is not None else _restore_float(base, part, mesh, verify)

    placed = read(rest, verify=True) if jax.tree.leaves(rest) else rest
    sums = {p: int(v[...]) for p, v in nnx.to_flat_state(base_model.checksums(placed))}
    out = list(nnx.to_flat_state(placed))
    for path, codes in kernels.items():
        if base.kind == "hf":
            state, sums[path] = _quantized_by_layer(base, path, codes, mesh)
        else:
            kernel = nnx.to_flat_state(read(nnx.from_flat_state([(path, float_kernel(codes))])))[0][1][...]
            sums[path] = base_model.part_checksum(kernel, 0)
            state = _quantize_on(kernel, codes, mesh)
            kernel.delete()
        out += [(path + sub, v) for sub, v in nnx.to_flat_state(state)]
    if identity is None:
        identity = base_model.digest_of(floats, nnx.from_flat_state([(p, sums[p]) for p, _ in
                                                                     nnx.to_flat_state(floats)]))
    return nnx.from_flat_state(out), identity


def _quantized_by_layer(base: base_model.Base, path: tuple, codes, mesh):
    """(the state of a Hugging Face base's kernel at `path`, quantised as `codes` says, read and quantised one
    layer at a time into the stack; the float kernel's checksum)."""
    whole = float_kernel(codes)
    layers = whole.shape[0]
    one = jax.ShapeDtypeStruct((1,) + whole.shape[1:], whole.dtype)
    with nnx.use_eager_sharding(False):
        layer_abstract = nnx.from_flat_state([(path, whole.replace(one))])
    stack_shapes = jax.eval_shape(lambda k: quantize_kernel(k, codes), whole.get_value())
    stack_shardings = sharding_tree(stack_shapes, mesh)
    stack = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stack_shapes),
                    out_shardings=stack_shardings)()
    quantize = lambda value: quantize_kernel(value, codes)  # `codes` brings its metadata only

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=stack_shardings)
    def write(stack, kernel, i):
        return jax.tree.map(lambda s, x: jax.lax.dynamic_update_slice_in_dim(s, x, i, 0), stack, quantize(kernel))

    read_layers = hf.param_reader(base.path, layer_abstract, mesh)
    checksum = 0
    for i in range(layers):
        kernel = nnx.to_flat_state(read_layers(i))[0][1][...]
        checksum += base_model.part_checksum(kernel, i * kernel.size)
        stack = write(stack, kernel, i)
        kernel.delete()
    return stack, checksum % 2**32


def _quantize_on(kernel, codes, mesh):
    """The quantised kernel's state (as `codes` describes it) of the float `kernel`, made on the devices into
    its shards."""
    quantize = lambda value: quantize_kernel(value, codes)  # `codes` brings its metadata only
    return jax.jit(quantize, out_shardings=sharding_tree(jax.eval_shape(quantize, kernel), mesh))(kernel)


def _placed_like(state, abstract, mesh):
    """The variables of `state` that `abstract` has (e.g. no lm_head for a reward model), placed per the rules."""
    wanted = {path for path, _ in nnx.to_flat_state(abstract)}
    kept = nnx.from_flat_state([(path, v) for path, v in nnx.to_flat_state(state) if path in wanted])
    return jax.device_put(kept, sharding_tree(abstract, mesh))
