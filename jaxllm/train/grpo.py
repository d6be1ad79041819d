"""Group relative policy optimisation as an objective: the policy is the base LM with fresh LoRA adapters,
trained by the shared step and loop on batches its own rollouts make. (Full fine-tuning needs a frozen copy of
the base as its reference, which is not built yet.)

An iteration: `GRPOBatches` takes the iteration's prompts, and the current policy (the variables the next step
updates, `BatchRequest.current`) samples grpo.num_generations responses to each with the KV-cache sampler, on
the run's mesh and from the same parameter arrays; the reward function scores them, `group_advantages` compares
each response with its group's, and the reference (the base with the adapters off: the frozen arrays, no copy)
gives its log-probabilities once. The iteration's rows then feed grpo.epochs passes of minibatches, one
optimizer step each, through `grpo_loss_fn` (jaxllm.post.losses.grpo_loss).

Everything an iteration made travels in the batch source's state, saved with every checkpoint: a run resumed in
the middle of an iteration trains on the very rollouts it had, and resumes bitwise. The policy's forward pass
uses no dropout, so that at an iteration's first update the ratio is 1 (TRL's GRPO disables dropout too). Prompts
are padded to one length (the bucket of grpo.max_prompt_tokens) and responses to grpo.max_new_tokens, so the
step compiles once. One process per run for now: the rollout is read back whole on the host.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import Config, ConfigError, GRPOConfig
from jaxllm.data.prompts import read_prompts
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.mesh import make_mesh
from jaxllm.metrics import JsonlWriter
from jaxllm.post import rewards
from jaxllm.post.losses import group_advantages, grpo_loss, kl_penalty, ppo_policy_loss
from jaxllm.post.pairs import masked_mean
from jaxllm.post.rollout import response_logits, response_logps, rollout, sequence_layout, token_entropy
from jaxllm.sample import bucket, left_pad
from jaxllm.train.dpo import reference_model
from jaxllm.train.finetune import data_errors, locate_base, tokenizer_path
from jaxllm.train.objective import BatchRequest, Objective
from jaxllm.train.pretrain import lm_objective, token_logps

# Token-mean aggregations count tokens; the others average over sequences.
_PER_TOKEN = ("dapo", "bnpo")


def grpo_loss_fn(model, batch, rng=None, *, grpo: GRPOConfig):
    """`loss_fn` of GRPO on a minibatch of rollout rows; `rng` is unused (no dropout: see the module doc)."""
    mask = batch["mask"]
    prompt_len = batch["tokens"].shape[1] - mask.shape[1]
    logits = response_logits(model, batch["tokens"], batch["segment_ids"], batch["positions"], prompt_len,
                             grpo.temperature)
    logps = token_logps(logits, batch["tokens"][:, prompt_len:])
    advantages = batch["advantages"]
    loss = grpo_loss(logps, batch["old_logps"], batch["ref_logps"] if grpo.beta else None, advantages, mask,
                     beta=grpo.beta, clip=grpo.clip, loss_agg=grpo.loss_agg, max_completion_length=mask.shape[1])
    count = jnp.sum(mask) if grpo.loss_agg in _PER_TOKEN else jnp.float32(mask.shape[0])
    _, clip_fraction, approx_kl = ppo_policy_loss(logps, batch["old_logps"],
                                                  jnp.broadcast_to(advantages, mask.shape), mask, grpo.clip)
    metrics = {"reward": jnp.mean(batch["rewards"]), "kl": masked_mean(kl_penalty(logps, batch["ref_logps"], "k3"),
                                                                        mask),
               "clip_fraction": clip_fraction, "approx_kl": approx_kl,
               "entropy": masked_mean(jax.lax.stop_gradient(token_entropy(logits)), mask),
               "response_length": jnp.mean(jnp.sum(mask, axis=1)), "eos_rate": jnp.mean(batch["stopped"])}
    return loss * count, count, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len", "temperature"))
def _logps(graphdef, variables, tokens, segment_ids, positions, *, prompt_len: int, temperature: float):
    return response_logps(nnx.merge(graphdef, variables), tokens, segment_ids, positions, prompt_len, temperature)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_token_scores(graphdef, variables, tokens, segment_ids, positions, last_B):
    scores_BS = nnx.merge(graphdef, variables)(tokens, segment_ids, positions)
    return jnp.take_along_axis(scores_BS, last_B[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class RewardModelScorer:
    """`grpo.reward=rm:<checkpoint>`: a trained reward model (jaxllm.model.reward.RewardModel, its own frozen
    arrays on the run's mesh) scores each rollout row at its last response token, as it scored each sequence's
    last token in training; the rows are the prompt rendered with the same template, then the response and its
    EOS, which is how its training pairs were encoded."""

    graphdef: object
    variables: object

    def __call__(self, tokens, segment_ids, positions, mask, prompt_len: int) -> np.ndarray:
        last = prompt_len + np.maximum(np.asarray(mask).sum(axis=1).astype(np.int32), 1) - 1
        return np.asarray(_last_token_scores(self.graphdef, self.variables, tokens, segment_ids, positions,
                                             jnp.asarray(last)))


def load_reward_model(spec: str, mesh, compute: str, vocab_size: int) -> RewardModelScorer:
    """The scorer of `rm:<checkpoint>` (a train.objective=reward run, a LoRA one included); ConfigError
    (grpo.reward) when it is not a reward model of the policy's vocabulary."""
    from jaxllm.checkpoint import CheckpointError
    from jaxllm.evaluate import load_checkpoint

    path = spec[len("rm:"):]
    try:
        loaded = load_checkpoint(path, mesh=mesh, compute=compute)
    except (CheckpointError, FileNotFoundError) as exc:
        raise ConfigError("grpo.reward", str(exc)) from None
    if (loaded.config.get("train") or {}).get("objective") != "reward":
        raise ConfigError("grpo.reward", f"{path} is not a reward model (train.objective=reward) checkpoint")
    if loaded.model_cfg.vocab_size != vocab_size:
        raise ConfigError("grpo.reward", f"{path} has a vocabulary of {loaded.model_cfg.vocab_size} tokens, the "
                                         f"policy {vocab_size}: they must share the tokenizer")
    return RewardModelScorer(loaded.graphdef, loaded.params)


@dataclasses.dataclass(frozen=True)
class Sampler:
    """What rollouts need: the policy's and the plain LM's graphs, the mesh, the tokenizer, the reward
    function and the settings."""

    graphdef: object
    plain_graphdef: object
    mesh: object
    tokenizer: object
    reward_fn: object  # fn(prompt, response) -> float, or a RewardModelScorer
    grpo: GRPOConfig
    prompt_len: int

    def respond(self, variables, prompts: list[dict], key, timings: dict | None = None) -> dict[str, np.ndarray]:
        """One sampled response to each prompt, scored: host arrays of the rows (tokens, layout, mask, the
        sampler's and the reference's log-probs, and per row [B, 1]: rewards, stopped; a batch field's leading
        axis is split over the batch mesh axes, its second is the sequence). `timings` gets the seconds spent
        sampling ("rollout_s") and scoring: the reference's log-probs and the rewards ("scoring_s")."""
        jax.block_until_ready(variables)  # the update that made them is not the rollout's time
        g, started = self.grpo, time.perf_counter()
        tokens_BP, start_B = left_pad([p["prompt_ids"] for p in prompts], len(prompts), self.prompt_len)
        with jax.set_mesh(self.mesh):
            out = rollout(self.graphdef, variables, tokens_BP, start_B, max_new_tokens=g.max_new_tokens,
                          temperature=g.temperature, stop_ids=(self.tokenizer.eos_id,), key=key)
            N = g.max_new_tokens  # the sampler's cache bucket may hold more slots: never filled
            mask = np.asarray(out.mask[:, :N])  # waits for the sampler
            sampled = time.perf_counter()
            tokens = out.tokens[:, : self.prompt_len + N]
            segment_ids, positions = sequence_layout(tokens, out.start)
            reference = reference_model(nnx.merge(self.graphdef, variables), self.plain_graphdef)
            ref_logps = _logps(self.plain_graphdef, nnx.state(reference), tokens, segment_ids, positions,
                               prompt_len=self.prompt_len, temperature=g.temperature)
            model_scores = (self.reward_fn(tokens, segment_ids, positions, mask, self.prompt_len)
                            if isinstance(self.reward_fn, RewardModelScorer) else None)
        rows = {"tokens": np.asarray(tokens), "segment_ids": np.asarray(segment_ids),
                "positions": np.asarray(positions), "mask": mask, "old_logps": np.asarray(out.logps[:, :N]),
                "ref_logps": np.asarray(ref_logps) * mask,
                "stopped": np.asarray(out.stopped, np.float32)[:, None]}
        rows["rewards"] = (model_scores.astype(np.float32)[:, None] if model_scores is not None else
                           np.asarray([[self.score(p, r, m)] for p, r, m in zip(prompts, rows["tokens"], mask)],
                                      np.float32))
        if timings is not None:
            timings.update(rollout_s=sampled - started, scoring_s=time.perf_counter() - sampled)
        return rows

    def response_text(self, row_tokens: np.ndarray, mask: np.ndarray) -> str:
        """A rollout row's response as text, without its EOS."""
        ids = row_tokens[self.prompt_len:][: int(mask.sum())]
        return self.tokenizer.decode([int(t) for t in ids if t != self.tokenizer.eos_id])

    def score(self, prompt: dict, row_tokens: np.ndarray, mask: np.ndarray) -> float:
        return float(self.reward_fn(prompt["prompt"], self.response_text(row_tokens, mask)))


def _encode(rows: dict[str, np.ndarray]) -> str:
    buffer = io.BytesIO()
    np.savez(buffer, **rows)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text))) as archive:
        return {k: archive[k] for k in archive.files}


class GRPOBatches:
    """The batch source of GRPO (see the module doc): data index i is step i of iteration i // S, S the steps
    an iteration takes; each epoch visits the iteration's rows in a seeded order."""

    def __init__(self, cfg: Config, request: BatchRequest, sampler: Sampler, prompts: list[dict]):
        g, tc = cfg.grpo, cfg.train
        self.samples = JsonlWriter(Path(cfg.workdir) / "samples.jsonl",
                                   enabled=bool(g.samples_every and g.samples) and jax.process_index() == 0)
        self.rows = g.prompts_per_iteration * g.num_generations
        self.batch_size, self.seed, self.grpo = tc.batch_size, tc.seed, g
        self.steps_per_epoch = self.rows // tc.batch_size
        self.steps_per_iteration = g.epochs * self.steps_per_epoch
        self.request, self.sampler, self.prompts = request, sampler, prompts
        self.index, self.end = request.first, request.end
        self.iteration, self.buffer = None, None
        self.timings: dict = {}  # of the rollout made for the batch given last (none: empty)
        saved = request.state or {}
        if "rollout" in saved and saved["iteration"] == self.index // self.steps_per_iteration:
            self.iteration, self.buffer = saved["iteration"], _decode(saved["rollout"])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.index >= self.end:
            raise StopIteration
        iteration, cursor = divmod(self.index, self.steps_per_iteration)
        self.timings = {}
        if iteration != self.iteration:
            self.iteration, self.buffer = iteration, self._make(iteration)
        epoch, k = divmod(cursor, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, iteration, epoch]).permutation(self.rows)
        rows = order[k * self.batch_size:(k + 1) * self.batch_size]
        index, count = self.request.rows
        block = len(rows) // count
        rows = rows[index * block:(index + 1) * block]
        self.index += 1
        return {name: values[rows] for name, values in self.buffer.items()}

    def _make(self, iteration: int) -> dict[str, np.ndarray]:
        """The iteration's rollouts from the current policy, with their group advantages."""
        G = self.grpo.num_generations
        order = np.random.default_rng([self.seed, iteration, 1 << 20]).permutation(len(self.prompts))
        chosen = [self.prompts[i] for i in np.resize(order, self.grpo.prompts_per_iteration)]
        key = jax.random.fold_in(jax.random.key(self.seed), iteration)
        rows = self.sampler.respond(self.request.current(), [p for p in chosen for _ in range(G)], key,
                                    self.timings)
        self.timings["rollout_tokens_per_sec"] = float(rows["mask"].sum()) / max(self.timings["rollout_s"], 1e-9)
        rows["advantages"] = np.asarray(group_advantages(rows["rewards"][:, 0], G), np.float32)[:, None]
        if self.grpo.samples_every and iteration % self.grpo.samples_every == 0:
            self._write_samples(iteration, chosen, rows)
        return rows

    def _write_samples(self, iteration: int, chosen: list[dict], rows: dict[str, np.ndarray]) -> None:
        """The first response to each of the first grpo.samples prompts of the iteration."""
        for i, prompt in enumerate(chosen[: self.grpo.samples]):
            r = i * self.grpo.num_generations
            self.samples.write({"iteration": iteration, "prompt": prompt["prompt"],
                                "response": self.sampler.response_text(rows["tokens"][r], rows["mask"][r]),
                                "reward": float(rows["rewards"][r, 0])})

    def step_metrics(self) -> dict:
        """Host metrics of the batch given last (jaxllm.train.loop.host_metrics): the seconds its iteration's
        rollouts took to sample and to score, and the sampler's tokens/s, at an iteration's first step; 0 at
        the others, so that sums over steps split the run's time."""
        return {"rollout_s": 0.0, "scoring_s": 0.0, **self.timings}

    def get_state(self) -> dict:
        state = {"step": self.index, "iteration": self.iteration}
        return {**state, "rollout": _encode(self.buffer)} if self.buffer is not None else state

    def close(self) -> None:
        self.samples.close()


def grpo_objective(cfg: Config, num_devices: int, log=print) -> tuple[Config, Objective]:
    """(cfg with the base's architecture, the GRPO objective), reading the prompts first."""
    cfg, base = locate_base(cfg, num_devices, "grpo")
    if base is None:
        raise ConfigError("checkpoint.restore_from", "GRPO starts from a model, its reference: name a jaxllm run or "
                                                     "a Hugging Face model directory")
    g = cfg.grpo
    mesh = make_mesh(cfg.mesh)
    if g.reward.startswith("rm:"):
        reward_fn = load_reward_model(g.reward, mesh, cfg.precision.compute, cfg.model.vocab_size)
    else:
        try:
            reward_fn = rewards.resolve(g.reward)
        except ValueError as exc:
            raise ConfigError("grpo.reward", str(exc)) from None
    tokenizer_file = tokenizer_path(cfg, base, "grpo")
    tokenizer = load_tokenizer(tokenizer_file)
    with data_errors("grpo"):
        prompts = read_prompts(g.train_file, g.eval_file, g.eval_fraction, cfg.train.seed, tokenizer, g.template,
                               g.max_prompt_tokens, log)
    if not prompts["train"]:
        raise ConfigError("grpo.train_file", f"no usable prompts in {g.train_file}")
    rope = base.rope_scaling
    plain = lm_objective(cfg.model, cfg.precision, cfg.pipeline, rope_scaling=rope)
    policy = lm_objective(cfg.model, cfg.precision, cfg.pipeline, cfg.lora if cfg.lora.rank else None,
                          rope_scaling=rope)
    sampler = Sampler(policy.graphdef, plain.graphdef, mesh, tokenizer, reward_fn, g,
                      bucket(g.max_prompt_tokens, 1))
    held_out = prompts["eval"][: g.eval_prompts]

    def report(graphdef, variables, mesh):
        if not held_out:
            return {"scores": {}, "samples": []}
        rows = sampler.respond(variables, held_out, jax.random.key(cfg.train.seed + 1))
        samples = [{"task": "grpo", "reference": p["prompt"][-60:], "response": sampler.response_text(r, mask)}
                   for p, r, mask in zip(held_out[:3], rows["tokens"], rows["mask"])]
        return {"scores": {"all": {"examples": len(held_out), "reward": float(rows["rewards"].mean()),
                                   "eos_rate": float(rows["stopped"].mean()),
                                   "length": float(rows["mask"].sum(axis=1).mean())}}, "samples": samples}

    def open_batches(request: BatchRequest):
        return GRPOBatches(cfg, request, sampler, prompts["train"])

    loss_fn = functools.partial(grpo_loss_fn, grpo=g)
    return cfg, dataclasses.replace(policy, name="grpo", loss_fn=loss_fn, open_batches=open_batches,
                                    eval_batches=None, tokenizer=tokenizer, sample_prompt=None, base=base,
                                    report=report)
