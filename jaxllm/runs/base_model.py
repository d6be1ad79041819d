"""The pretrained base a fine-tuning run starts from: where it is, its architecture and tokenizer, how its
parameters load, and the fingerprint that ties the run's checkpoints to it.

`checkpoint.restore_from` names the base: a jaxllm run (its workdir, checkpoints directory or one step directory)
or a Hugging Face model directory (config.json + safetensors). A LoRA fine-tuning run's checkpoint is a base too:
its adapters merged into the base it records (kind "jaxllm-lora"; DPO starts from a LoRA SFT run this way, and
the merged model is its frozen reference). The run adopts the base's architecture. A LoRA
run's checkpoints hold the adapters and their optimizer state only, plus a `base` record (kind, path, step,
fingerprint) in their metadata; a resume loads the base again and refuses one whose fingerprint differs.

The fingerprint is a checksum of the bits of every base array: per leaf, a wrapping uint32 sum of each element's
bit pattern times a hash of its position, combined with the leaf paths, shapes and dtypes by sha256. Integer sums
are exact in any order, so the fingerprint is the same on every mesh and device count. A LoRA run's base is
fingerprinted by its arrays as stored (its adapters and its own base's arrays), not by their merge, whose last bits
follow the compiler.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.rope import RopeScaling
from jaxllm.model.lora import ADAPTER_SUFFIX
from jaxllm.runs.checkpoint import CheckpointError, Checkpointer, locate_checkpoints
from jaxllm.config.schema import Config, ConfigError, ModelConfig, check_across
from jaxllm.interop import hf

# The RoPE scaling's fields: adopted from a base that has a scaling, else this run's (to extend the context).
ROPE_FIELDS = ("rope_scaling", "rope_scaling_factor", "rope_original_context")
# ModelConfig fields that describe the network itself (adopted from the base); the others (remat, attention,
# init_std, preset) are choices of this run.
ARCHITECTURE = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "rope_theta",
                "norm_eps", "tie_embeddings", "family", "sliding_window", "global_every", "local_rope_theta",
                "query_pre_attn_scalar", "num_experts", "experts_per_token", "moe_renormalize",
                "moe_shared_mlp_dim") + ROPE_FIELDS
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_KEY = "checkpoint.restore_from"


@dataclasses.dataclass(frozen=True)
class Base:
    """A located base: `kind` "jaxllm" or "jaxllm-lora" (`path` is a step directory) or "hf" (a model
    directory); `config`, the configuration a jaxllm run recorded with that checkpoint (None for "hf")."""

    kind: str
    path: Path
    step: int | None
    architecture: dict
    tokenizer: Path | None
    rope_scaling: object = None
    config: dict | None = None

    def record(self, fingerprint: str) -> dict:
        """What a run's checkpoints say of their base."""
        return {"kind": self.kind, "path": str(self.path), "step": self.step, "fingerprint": fingerprint}


def is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def locate(restore_from: str) -> Base:
    """The base named by `checkpoint.restore_from`; ConfigError when it is neither kind."""
    path = Path(restore_from).absolute()
    if is_hf_directory(path):
        hf_cfg = json.loads((path / "config.json").read_text())
        try:
            architecture = dataclasses.asdict(hf.config_from_hf(hf_cfg))
            scaling = hf.rope_scaling_from_hf(hf_cfg)
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(_KEY, f"{path}: {exc}") from None
        tokenizer = next((path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()), None)
        return Base("hf", path, None, {k: architecture[k] for k in ARCHITECTURE}, tokenizer, scaling)
    directory, step = locate_checkpoints(str(path))
    source = Checkpointer(directory, keep=1000, log=lambda *_: None)
    try:
        step = source.latest_step() if step is None else step
        if step is None:
            raise ConfigError(_KEY, f"{path} is neither a Hugging Face model directory nor a jaxllm run with a "
                                    "committed checkpoint")
        meta = source.read_meta(step)
        adapters = holds_adapters(source.saved_param_names(step))
    except CheckpointError as exc:
        raise ConfigError(_KEY, str(exc)) from None
    finally:
        source.close()
    config = meta.get("config") or {}
    if "model" not in config:
        raise ConfigError(_KEY, f"{directory / str(step)}: its metadata records no model config")
    kind, rope_scaling = "jaxllm", None
    if adapters:
        record = meta.get("base") or {}
        if not record.get("path"):
            raise ConfigError(_KEY, f"{directory / str(step)} holds LoRA adapters and records no base model")
        kind, rope_scaling = "jaxllm-lora", locate(record["path"]).rope_scaling
    # runs from before model families record no family (Llama) and no window
    defaults = dataclasses.asdict(ModelConfig())
    return Base(kind, Path(directory) / str(step), step, {k: config["model"].get(k, defaults[k]) for k in ARCHITECTURE},
                _store_tokenizer((config.get("data") or {}).get("path")), rope_scaling, config)


def holds_adapters(saved_names: set[str]) -> bool:
    """Whether a checkpoint whose parameter arrays have these names (`Checkpointer.saved_param_names`) holds LoRA
    adapters (on a base it records) rather than a whole model: what it holds says so, whichever objective (SFT,
    reward, DPO, GRPO, PPO) wrote it."""
    return any(f"{ADAPTER_SUFFIX}/" in name for name in saved_names)


def _store_tokenizer(store: str | None) -> Path | None:
    """The tokenizer file of a token store (its manifest names it)."""
    if not store or not (Path(store) / "manifest.json").is_file():
        return None
    name = json.loads((Path(store) / "manifest.json").read_text()).get("tokenizer", "tokenizer.model")
    return Path(store) / name


def adopt_architecture(cfg: Config, base: Base) -> Config:
    """`cfg` with the base's architecture, checked again against the mesh and the rest of the config (the dims
    may differ from the config file's)."""
    model = dataclasses.replace(cfg.model, **{**base.architecture, **_rope_fields(cfg.model, base)})
    if model == cfg.model:
        return cfg
    adopted = dataclasses.replace(cfg, model=model)
    try:
        model.check()
        check_across(adopted)
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{exc.reason} (with the architecture of the base {base.path})") from None
    return adopted


def _rope_fields(model: ModelConfig, base: Base) -> dict:
    """The run's model.rope_scaling fields: the base's (a jaxllm run's recorded ones; a Hugging Face base's
    scaling travels as `base.rope_scaling`, its fields "none") unless the config sets a scaling, which may extend
    a base without one, or restate the base's, but not replace it."""
    theirs = {k: base.architecture[k] for k in ROPE_FIELDS}
    base_scaling = base.rope_scaling or RopeScaling.from_model_config(dataclasses.replace(model, **theirs))
    ours = RopeScaling.from_model_config(model)
    if base_scaling is not None and ours not in (None, base_scaling):
        raise ConfigError("model.rope_scaling", f"the base {base.path} has its own RoPE scaling "
                                                f"({base_scaling.rope_type}, factor {base_scaling.factor}): leave "
                                                "model.rope_scaling=none to keep it")
    return {k: getattr(model, k) for k in ROPE_FIELDS} if base_scaling is None or ours is not None else theirs


def _leaf_checksum(x: jax.Array, start=0) -> jax.Array:
    """The checksum of `x`, or of the part of a larger leaf whose flattened elements from `start` on `x` is (a
    leaf's checksum is the wrapping sum of its parts')."""
    bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    # each element's row-major position, from iotas in the array's own shape: a flattened (raveled) copy of a
    # sharded array would be gathered whole onto every device first (8x a base's bytes on 8 devices)
    positions, stride = jnp.asarray(start, jnp.uint32), 1
    for axis in reversed(range(x.ndim)):
        positions = positions + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    weights = positions * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def part_checksum(x: jax.Array, start: int) -> int:
    """`_leaf_checksum` of a part of a leaf starting at flattened element `start` (layer by layer loading)."""
    return int(jax.jit(_leaf_checksum)(x, np.uint32(start % 2**32)))


def fingerprint(tree) -> str:
    """A hex digest of every array in `tree` (the same on any mesh; see the module docstring)."""
    return digest_of(tree, checksums(tree))


def checksums(tree):
    """Each array's checksum in `tree` (the same tree of uint32 scalars, on the host)."""
    return jax.device_get(jax.jit(lambda t: jax.tree.map(_leaf_checksum, t))(tree))


def digest_of(tree, sums) -> str:
    """The fingerprint of `tree` (arrays or ShapeDtypeStructs) from its leaves' `checksums`, which may have been
    taken part by part (a base loaded one kernel at a time)."""
    digest = hashlib.sha256()
    for (path, leaf), checksum in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(sums), strict=True):
        digest.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}:{int(checksum)};".encode())
    return digest.hexdigest()[:32]


def accepted(recorded: dict | None, identity: str, loaded) -> dict | None:
    """The base record a resume checks against: `recorded`, unless it holds the fingerprint of the `loaded`
    arrays rather than the base's `identity` (`jaxllm.runs.loader.load_base`), as runs on a LoRA base recorded
    before 2026-12-04: then it is the same base, and the record is read as the identity's."""
    old = recorded and recorded.get("fingerprint") not in (None, identity)
    if old and recorded["fingerprint"] == fingerprint(loaded):
        return dict(recorded, fingerprint=identity)
    return recorded


def check_same_base(recorded: dict | None, current: dict) -> None:
    """Raise ConfigError when a run's checkpoints were trained on another base than `current`."""
    if recorded and recorded.get("fingerprint") != current["fingerprint"]:
        raise ConfigError(_KEY, f"{current['path']} (fingerprint {current['fingerprint']}) is not the base this "
                                f"run's checkpoints were trained on ({recorded.get('path')}, fingerprint "
                                f"{recorded.get('fingerprint')})")
