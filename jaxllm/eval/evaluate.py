"""Evaluation of a trained model: held-out perplexity on a token store and multiple-choice accuracy.

Also the shared loader for a jaxllm checkpoint as a standalone model (`load_checkpoint`): the model config is
read from the checkpoint's metadata and only the parameters are restored (never the optimizer state), so
scripts (export, generate, eval) work on any run's checkpoint regardless of its optimizer or mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.runs.checkpoint import CheckpointError, Checkpointer
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, PrecisionConfig
from jaxllm.parallel.mesh import make_mesh


def single_device_mesh() -> jax.sharding.Mesh:
    return make_mesh(MeshConfig(), devices=jax.devices()[:1])


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
        from jaxllm.data.tokenizer import find_tokenizer_file

        candidates = []
        if self.meta.get("tokenizer"):
            candidates.append(Path(self.meta["tokenizer"]))
        data_path = (self.config.get("data") or {}).get("path")
        if data_path:
            candidates.append(find_tokenizer_file(data_path))
        return next((c for c in candidates if c is not None and c.is_file()), None)


def _model_objective(config: dict, model_cfg, precision, rope_scaling=None):
    """The model half (build, trainable filter) of the objective a run with this recorded config trained: the
    LM or the reward model, with the run's adapters when its checkpoints hold them."""
    from jaxllm.train.base_model import holds_adapters
    from jaxllm.objectives.pretrain import lm_objective
    from jaxllm.objectives.reward import reward_model_objective

    lora = LoRAConfig(**_fields(LoRAConfig, config.get("lora"))) if holds_adapters(config) else None
    make = reward_model_objective if (config.get("train") or {}).get("objective") == "reward" else lm_objective
    return make(model_cfg, precision, lora=lora, rope_scaling=rope_scaling)


def _load_adapted(source: Checkpointer, step: int, meta: dict, model_cfg, precision, mesh):
    """(graphdef, params) of a LoRA run's checkpoint: its adapters (and other trainable variables) on the base
    model its metadata records (loaded again, and checked against the recorded fingerprint)."""
    from jaxllm.train import base_model

    record = meta.get("base") or {}
    if not record.get("path"):
        raise CheckpointError(f"{source.directory / str(step)}: adapters of a run with no base model recorded")
    base = base_model.locate(record["path"])
    objective = _model_objective(meta["config"], model_cfg, precision, base.rope_scaling)
    _, abstract_adapters, abstract_base = jax.eval_shape(lambda: objective.split(objective.build_model(jax.random.key(0))))
    adapters = source.restore_params(step, abstract_adapters, mesh)
    frozen = base.load(abstract_base, mesh)
    base_model.check_same_base(record, base.record(base_model.fingerprint(frozen)))
    return objective.graphdef, nnx.merge_state(adapters, frozen)


def load_checkpoint(path: str, step: int | None = None, mesh=None, compute: str | None = None) -> LoadedCheckpoint:
    """A checkpoint (run workdir, checkpoints directory or one step directory) as graphdef + params.

    A LoRA fine-tuning run's checkpoint holds adapters only: they are loaded onto the base model it records (the
    model then carries the adapters; `jaxllm.model.lora.merge` or `hf.save_pretrained` give the merged one). A reward
    model run gives a jaxllm.model.reward.RewardModel.
    Computation runs in the parameter dtype unless `compute` is given; logits are float32.
    """
    from jaxllm.train.base_model import holds_adapters
    from jaxllm.train.recovery import _locate

    mesh = single_device_mesh() if mesh is None else mesh
    directory, located = _locate(path)
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
        with jax.set_mesh(mesh):
            if holds_adapters(config):
                graphdef, params = _load_adapted(source, step, meta, model_cfg, precision, mesh)
            else:
                objective = _model_objective(config, model_cfg, precision)
                graphdef, abstract_params = jax.eval_shape(lambda: nnx.split(objective.build_model(jax.random.key(0))))
                params = source.restore_params(step, abstract_params, mesh)
    finally:
        source.close()
    return LoadedCheckpoint(graphdef, params, model_cfg, precision, config, meta, Path(directory) / str(step))


# ------------------------------------------------------------------------------------------- perplexity


def perplexity(graphdef, params, mesh, store_path, *, split: str = "eval", seq_len: int = 128,
               batch_size: int = 8, max_batches: int | None = None) -> dict:
    """Token-weighted held-out loss over `loss_mask` (packing-aware) and its exponential."""
    from jaxllm.data.pipeline import make_eval_batches
    from jaxllm.train.step import batch_sharding, jit_eval_step, make_eval_step

    batches = make_eval_batches(store_path, split=split, batch_size=batch_size, seq_len=seq_len,
                                max_batches=max_batches)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    with jax.set_mesh(mesh):
        step = jit_eval_step(make_eval_step(graphdef), param_shardings, mesh)
        sharding = batch_sharding(mesh)
        total, count = 0.0, 0.0
        for batch in batches:
            batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
            s, c = jax.device_get(step(params, batch))
            total += float(s)
            count += float(c)
    if count == 0:
        raise ValueError(f"split {split!r} of {store_path} has no tokens to evaluate")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count), "batches": len(batches)}


# ------------------------------------------------------------------------------------- multiple choice


def read_choices(path) -> list[dict]:
    """JSON lines with `question`, `choices` (list of strings) and `answer` (index)."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            question, choices, answer = item["question"], list(item["choices"]), int(item["answer"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected {{question, choices, answer}}: {exc}") from None
        if not choices or not 0 <= answer < len(choices):
            raise ValueError(f"{path}:{n}: answer {answer} is not an index into {len(choices)} choices")
        items.append({"question": question, "choices": choices, "answer": answer})
    return items


def encode_choice(tokenizer, question: str, choice: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids): the continuation is what `question + choice` adds to `question`."""
    context = [tokenizer.bos_id] + tokenizer.encode(question)
    full = [tokenizer.bos_id] + tokenizer.encode(question + choice)
    if full[:len(context)] == context and len(full) > len(context):
        return context, full[len(context):]
    return context, tokenizer.encode(choice)


def _bucket(n: int, multiple: int = 16) -> int:
    return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnums=0)
def _logprobs(graphdef, params, tokens_BT):
    logits = nnx.merge(graphdef, params)(tokens_BT).astype(jnp.float32)
    return jax.nn.log_softmax(logits, axis=-1)


def continuation_logprobs(graphdef, params, mesh, pairs: Sequence[tuple[list[int], list[int]]]) -> list[float]:
    """Summed log-likelihood of each continuation given its context (one forward pass per group of pairs)."""
    if not pairs:
        return []

    seqs = [ctx + cont for ctx, cont in pairs]
    if any(len(cont) == 0 for _, cont in pairs):
        raise ValueError("a choice encodes to no tokens")
    length = _bucket(max(len(s) for s in seqs) - 1)
    tokens = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s) - 1] = s[:-1]  # inputs; position t predicts s[t + 1]
    with jax.set_mesh(mesh):
        lp = np.asarray(jax.device_get(_logprobs(graphdef, params, jnp.asarray(tokens))))
    out = []
    for i, (ctx, cont) in enumerate(pairs):
        positions = np.arange(len(ctx) - 1, len(ctx) - 1 + len(cont))
        out.append(float(lp[i, positions, cont].sum()))
    return out


def multiple_choice(graphdef, params, mesh, tokenizer, items: Iterable[dict]) -> dict:
    """Accuracy by summed log-likelihood, per-token mean and per-character (`norm`) of each choice."""
    items = list(items)
    right = right_token = right_char = 0
    for item in items:
        pairs = [encode_choice(tokenizer, item["question"], c) for c in item["choices"]]
        scores = np.asarray(continuation_logprobs(graphdef, params, mesh, pairs))
        per_token = scores / np.asarray([len(cont) for _, cont in pairs])
        per_char = scores / np.asarray([max(len(c), 1) for c in item["choices"]])
        right += int(np.argmax(scores) == item["answer"])
        right_token += int(np.argmax(per_token) == item["answer"])
        right_char += int(np.argmax(per_char) == item["answer"])
    n = max(len(items), 1)
    return {"mc_accuracy": right / n, "mc_accuracy_norm": right_char / n, "mc_accuracy_per_token": right_token / n,
            "mc_questions": len(items)}
