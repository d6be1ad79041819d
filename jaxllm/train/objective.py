"""What a training objective is: data, not a trainer subclass.

Pretraining, SFT, a reward model, DPO, PPO and GRPO differ in four things only (../DESIGN.md section 9): how the
model is built, which of its variables train, the loss, and where batches come from. An `Objective` holds those
four; the train state, the step, the loop, checkpoints, recovery and sharding are shared and know nothing else.

How the interface covers what comes later:
- batches that depend on the current parameters (rollouts): `open_batches` receives `current`, a function giving
  the variables of the model the next step will update, and a source may generate from it; what it generated
  goes into its `get_state()`, saved with each checkpoint and handed back as `BatchRequest.state` on resume;
- several update epochs over one batch: a source yields the same rollout's minibatches as often as it likes;
  each `next` is one optimizer step;
- two trainable models with their own optimizers (policy and value): the model is one module holding both, the
  `trainable` filter selects both, and the optimizer is an `optax.multi_transform` keyed by parameter path;
- frozen models used only for scoring (reference, reward): non-trainable variables of the model, passed to the
  step as inputs that are never donated, differentiated or given optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol

import jax
from flax import nnx


class BatchSource(Protocol):
    """Host-local numpy batches, one per optimizer step, with a resumable position."""

    def __next__(self) -> dict: ...

    def get_state(self) -> dict:
        """JSON-serialisable position, stored in each checkpoint."""

    def close(self) -> None: ...


SFT_TASK = "sft_task"  # a report's entry for its base's SFT task (post-training runs on an SFT run)


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """What the loop asks a batch source for: data indices [first, end) (data index = step - 1 + offset) of
    this process's block `rows` = (index, count) of every global batch, `current()`, the variables (trainable
    and frozen, one nnx.State) of the model the next step will update, for sources that generate from the
    current parameters, `trained()` the trainable ones alone, and `state`, the source state saved with the
    checkpoint the run (re)starts from (None: a fresh run)."""

    first: int
    end: int
    rows: tuple[int, int]
    current: Callable[[], Any]
    state: dict | None = None
    trained: Callable[[], Any] | None = None


# loss_fn(model, batch, rng) -> (loss_sum, token_count, metrics); rng is None for evaluation (no dropout).
# `metrics` are scalars summed over a batch's micro-batches and reported divided by their number.
LossFn = Callable[[nnx.Module, dict, Any], tuple[jax.Array, jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class Objective:
    """One kind of training.

    `build_model(key)` constructs the model (jaxllm's logical names decide its placement); `trainable` is an nnx
    filter of the variables that learn, the rest are frozen; `loss_fn` is above; `open_batches(BatchRequest)`
    gives the train batches and `eval_batches(rows)` a list of held-out ones (None: no evaluation). `tokenizer`
    and `sample_prompt` drive the end-of-run sample of language models ("" prompts with BOS alone, None: no
    sample). `base` (jaxllm.runs.base_model.Base) is the pretrained model a fresh run loads instead of
    initialising: into the frozen variables when there are any (adapters), else into the trainable ones (full
    fine-tuning); `fresh` filters the trainable variables a base does not have (a reward model's score head),
    which are initialised from the seed instead. `report(graphdef, variables, mesh)` gives task metrics of a
    model ({"scores": {group: {"examples": n, metric: value}}, "samples": [...]}, and under SFT_TASK the scores of
    the SFT task its base was fine-tuned for: jaxllm/objectives/retention.py), taken before and after training.
    `progress_metrics` name the loss_fn metrics the progress line shows beside the loss. `own` filters the
    variables the objective loads itself, neither from the base nor from the seed, with `load_own(abstract,
    mesh)` (their abstract state -> the variables, placed): PPO's critic started from a reward model.
    `periodic_eval(graphdef, variables, mesh)` gives flat {name: number} metrics of the model in training (the
    harness tasks of `eval.harness_every`), taken every `periodic_eval_every` steps and after the last one.
    """

    name: str
    build_model: Callable[[jax.Array], nnx.Module]
    loss_fn: LossFn
    trainable: Any = nnx.Param
    open_batches: Callable[[BatchRequest], BatchSource] | None = None
    eval_batches: Callable[[tuple[int, int]], list[dict]] | None = None
    tokenizer: Any = None
    sample_prompt: str | None = ""
    base: Any = None
    fresh: Any = None
    report: Callable[[nnx.GraphDef, Any, Any], dict] | None = None
    progress_metrics: tuple[str, ...] = ()
    own: Any = None
    load_own: Callable[[Any, Any], Any] | None = None
    periodic_eval: Callable[[nnx.GraphDef, Any, Any], dict] | None = None
    periodic_eval_every: int = 0

    @functools.cached_property
    def graphdef(self) -> nnx.GraphDef:
        """The model's structure (no arrays allocated)."""
        return jax.eval_shape(lambda: nnx.split(self.build_model(jax.random.key(0))))[0]

    def split(self, model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
        """(graphdef, trainable variables, frozen variables) of `model`."""
        return nnx.split(model, self.trainable, ...)

