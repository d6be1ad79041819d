"""What PPO and GRPO share: the sampler that makes scored rollouts from the current policy, the reward (a
registered function or a trained reward model), the batch source of iterations, and the held-out report.

An iteration: the batch source takes the iteration's prompts, and the current policy (the variables the next
step updates, `BatchRequest.current`) samples responses with the KV-cache sampler, on the run's mesh and from
the same parameter arrays; the reward scores them and the reference (the base with the adapters off: the frozen
arrays, no copy) gives its log-probabilities once. The objective's `score` hook then turns the rows into what
its loss needs (GRPO: group advantages; PPO: values, per-token rewards, GAE), and the iteration's rows feed
`epochs` passes of minibatches, one optimizer step each.

Everything an iteration made travels in the batch source's state, saved with every checkpoint: a run resumed in
the middle of an iteration trains on the very rollouts it had, and resumes bitwise. The policy's forward pass
uses no dropout, so that at an iteration's first update the ratio is 1 (TRL's PPO and GRPO disable dropout
too). Prompts are bucketed by length: an iteration's prompts are left-padded to its longest one rounded up to a
multiple of PROMPT_BUCKET tokens (at most max_prompt_tokens rounded up), its responses to max_new_tokens, so
short prompts cost short rows and the step compiles once per bucket (jaxllm.train.step_runner.StepRunner). One
process or many: each samples, scores and keeps its own block of an iteration's rows (the rows its devices
train on), and only sums over all rows (PPO's whitening and KL controller, the held-out report) cross processes.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import functools
import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxllm.config.fine_tuning import RolloutConfig
from jaxllm.config.schema import Config, ConfigError
from jaxllm.data.prompts import read_prompts
from jaxllm.data.sft_template import stop_ids
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.parallel.host_rows import (per_block, process_rows, row_shards, sum_over_blocks, texts_per_block, to_global,
                                      to_local)
from jaxllm.parallel.mesh import rollout_mesh, run_mesh
from jaxllm.parallel.sharding import reshard, spec_leaves
from jaxllm.observe.metrics import JsonlWriter
from jaxllm.objectives import reward_fns as rewards
from jaxllm.objectives.retention import with_sft_task
from jaxllm.objectives.rollout import response_logps, rollout, sequence_layout
from jaxllm.objectives.rollout_ahead import RolloutAhead
from jaxllm.model.lora import adapters_off
from jaxllm.model.reference import reference_model
from jaxllm.model.sample import left_pad
from jaxllm.objectives.finetune import data_errors, locate_base, tokenizer_path
from jaxllm.train.objective import BatchRequest, Objective
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.runs.checkpoint import CheckpointError
from jaxllm.runs.loader import load_base, load_checkpoint
from jaxllm.train.step import batch_sharding


# Prompt buckets are multiples of this many tokens: finer than the sampler's powers of two (prompts of 65 tokens
# cost rows of 96 + max_new_tokens, not 128 + max_new_tokens), with a few compiled shapes.
PROMPT_BUCKET = 32


def prompt_bucket(longest: int, max_prompt_tokens: int) -> int:
    """The padded prompt length of an iteration whose longest prompt has `longest` tokens."""
    round_up = lambda n: PROMPT_BUCKET * max(1, -(-n // PROMPT_BUCKET))
    return min(round_up(longest), round_up(max_prompt_tokens))


def rollout_rows(cfg: Config, section: str) -> Config:
    """`cfg` with train.seq_len the length of the longest rollout rows of `cfg.<section>` (the largest prompt
    bucket and the responses): what the loop plans memory and FLOPs for, and auto-fit chooses for."""
    settings: RolloutConfig = getattr(cfg, section)
    longest = prompt_bucket(settings.max_prompt_tokens, settings.max_prompt_tokens) + settings.max_new_tokens
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=longest))


def rows_prompt_len(rows: dict[str, np.ndarray]) -> int:
    """The prompt length of rollout rows: their slots less the response slots."""
    return rows["tokens"].shape[1] - rows["mask"].shape[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len", "temperature"))
def _logps(graphdef, variables, tokens, segment_ids, positions, *, prompt_len: int, temperature: float):
    return response_logps(nnx.merge(graphdef, variables), tokens, segment_ids, positions, prompt_len, temperature)


@functools.partial(jax.jit, static_argnames=("graphdef", "plain_graphdef", "prompt_len", "temperature", "value_fn"))
def _scoring_pass(graphdef, plain_graphdef, variables, reference, tokens, segment_ids, positions, *, prompt_len: int,
                  temperature: float, value_fn=None):
    """The reference's log-probs of the rollout rows and, with `value_fn(model, tokens, segment_ids, positions,
    prompt_len)` (PPO's critic), their values: one program over the arrays the two share (the frozen base is one
    input, read by both passes), one dispatch and one read-back."""
    out = {"ref_logps": response_logps(nnx.merge(plain_graphdef, reference), tokens, segment_ids, positions,
                                       prompt_len, temperature)}
    if value_fn is not None:
        out["values"] = value_fn(nnx.merge(graphdef, variables), tokens, segment_ids, positions, prompt_len)
    return out


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_token_scores(graphdef, variables, tokens, segment_ids, positions, last_B):
    scores_BS = nnx.merge(graphdef, variables)(tokens, segment_ids, positions)
    return jnp.take_along_axis(scores_BS, last_B[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class RewardModelScorer:
    """`reward=rm:<checkpoint>`: a trained reward model (jaxllm.model.reward.RewardModel, its own frozen arrays
    on the run's mesh) scores each rollout row at its last response token, as it scored each sequence's last
    token in training; the rows are the prompt rendered with the same template, then the response and its EOS,
    which is how its training pairs were encoded."""

    graphdef: object
    variables: object

    def __call__(self, tokens, segment_ids, positions, mask, prompt_len: int) -> jax.Array:
        """Scores [B] of rows laid out as the sampler made them (global arrays)."""
        last = prompt_len + jnp.maximum(mask.sum(axis=1).astype(jnp.int32), 1) - 1
        return _last_token_scores(self.graphdef, self.variables, tokens, segment_ids, positions, last)


def load_reward_model(spec: str, mesh, compute: str, vocab_size: int, key: str) -> RewardModelScorer:
    """The scorer of `rm:<checkpoint>` (a train.objective=reward run, a LoRA one included); ConfigError (`key`)
    when it is not a reward model of the policy's vocabulary."""
    path = spec[len("rm:"):]
    try:
        loaded = load_checkpoint(path, mesh=mesh, compute=compute)
    except (CheckpointError, FileNotFoundError) as exc:
        raise ConfigError(key, str(exc)) from None
    if (loaded.config.get("train") or {}).get("objective") != "reward":
        raise ConfigError(key, f"{path} is not a reward model (train.objective=reward) checkpoint")
    if loaded.model_cfg.vocab_size != vocab_size:
        raise ConfigError(key, f"{path} has a vocabulary of {loaded.model_cfg.vocab_size} tokens, the policy "
                               f"{vocab_size}: they must share the tokenizer")
    return RewardModelScorer(loaded.graphdef, loaded.params)


class WeightSync:
    """The trainer's variables on the rollout devices (rl.placement=disaggregated): each array resharded onto
    the rollout mesh by its logical names (`jax.device_put`), the arrays unchanged since the last call (the
    frozen base) reused, not copied again. Across processes the copy goes through the hosts
    (`jaxllm.parallel.sharding.reshard`)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.sources: list = []  # the trainer's arrays of the last call, and their copies here
        self.copies: list = []

    def __call__(self, variables) -> tuple[object, float]:
        """(`variables` on the rollout mesh, seconds until every copy landed; not the wait for the update that
        made them)."""
        leaves, treedef = jax.tree.flatten(jax.block_until_ready(variables))
        started = time.perf_counter()
        known = dict(zip(map(id, self.sources), self.copies))
        shardings = [NamedSharding(self.mesh, spec) for spec in spec_leaves(variables, self.mesh)]
        copies = [known[id(x)] if id(x) in known else reshard(x, s) for x, s in zip(leaves, shardings)]
        jax.block_until_ready(copies)
        self.sources, self.copies = leaves, copies
        return jax.tree.unflatten(treedef, copies), time.perf_counter() - started


@dataclasses.dataclass(frozen=True)
class Sampler:
    """What rollouts need: the policy's and the plain LM's graphs, the mesh, the tokenizer, the reward
    function and the settings."""

    graphdef: object
    plain_graphdef: object
    mesh: object
    tokenizer: object
    reward_fn: object  # fn(prompt, response) -> float, or a RewardModelScorer
    settings: RolloutConfig
    stop_ids: tuple[int, ...]  # where a response ends (jaxllm.data.sft_template.stop_ids of the prompts' template)
    sync: WeightSync | None = None  # rl.placement=disaggregated: the trainer's variables to `mesh`
    # One program at a time on the sampler's devices: a rollout sampled ahead (its own thread) and the held-out
    # report must not interleave their collectives there.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, compare=False)
    reference: object = None  # full fine-tuning: the base's weights on `mesh`, the frozen reference
    value_fn: object = None  # PPO: the critic's values, computed with the reference's log-probs (`_scoring_pass`)

    def reference_variables(self, variables):
        """The reference's variables: the base with the adapters off (the same arrays as `variables`'), or
        under full fine-tuning the base's own weights, frozen on this sampler's devices (`reference`)."""
        if self.reference is not None:
            return self.reference
        return nnx.state(reference_model(nnx.merge(self.graphdef, variables), self.plain_graphdef))

    def receive(self, variables) -> tuple[object, float]:
        """The trainer's `variables` where this sampler samples, and the seconds the copy took (0: the same
        devices, no copy)."""
        if self.sync is None:
            return variables, 0.0
        with self.lock:
            return self.sync(variables)

    @property
    def rows_sharding(self):
        return batch_sharding(self.mesh)

    def block(self, rows: int) -> tuple[int, int]:
        """(index, count): the block of `rows` rows this process samples, scores and keeps."""
        return process_rows(self.rows_sharding, rows)

    def respond(self, variables, prompts: list[dict], key, timings: dict | None = None) -> dict[str, np.ndarray]:
        """One sampled response to each prompt, scored: this process's block (`block(len(prompts))`) of the rows
        as host arrays (tokens, layout, mask, the sampler's and the reference's log-probs, PPO's critic values
        [B, N] with `value_fn`, and per row [B, 1]:
        scores, stopped). Every process passes every prompt (the same list): the rows are laid out over the
        batch mesh axes, each process samples and reads back its own block only. `timings` gets the seconds
        spent sampling ("rollout_s") and scoring: the reference's log-probs and the scores ("scoring_s")."""
        with self.lock:
            return self._respond(variables, prompts, key, timings)

    def _respond(self, variables, prompts: list[dict], key, timings: dict | None) -> dict[str, np.ndarray]:
        jax.block_until_ready(variables)  # the update that made them is not the rollout's time
        s, started = self.settings, time.perf_counter()
        P = prompt_bucket(max(len(p["prompt_ids"]) for p in prompts), s.max_prompt_tokens)
        block = self.block(len(prompts))
        size = len(prompts) // block[1]
        mine = prompts[block[0] * size:(block[0] + 1) * size]
        tokens_BP, start_B = left_pad([p["prompt_ids"] for p in mine], size, P)
        placed = to_global({"tokens": tokens_BP, "start": start_B}, self.rows_sharding, len(prompts))
        with jax.set_mesh(self.mesh):
            out = rollout(self.graphdef, variables, placed["tokens"], placed["start"],
                          max_new_tokens=s.max_new_tokens, temperature=s.temperature, stop_ids=self.stop_ids,
                          key=key, vocab_limit=self.tokenizer.vocab_size, slots=s.decode_slots)
            N = s.max_new_tokens  # the sampler's cache bucket may hold more slots: never filled
            tokens = out.tokens[:, : P + N]
            segment_ids, positions = sequence_layout(tokens, out.start)
            sampled = self.read({"tokens": tokens, "segment_ids": segment_ids, "positions": positions,
                                 "mask": out.mask[:, :N], "old_logps": out.logps[:, :N],
                                 "stopped": out.stopped.astype(jnp.float32)[:, None]}, block)  # waits for it
            done_sampling = time.perf_counter()
            scored = _scoring_pass(self.graphdef, self.plain_graphdef, variables, self.reference_variables(variables),
                                   tokens, segment_ids, positions, prompt_len=P, temperature=s.temperature,
                                   value_fn=self.value_fn)
            if isinstance(self.reward_fn, RewardModelScorer):
                scored["scores"] = self.reward_fn(tokens, segment_ids, positions, out.mask[:, :N], P)[:, None]
            rows = {**sampled, **self.read(scored, block)}
        rows["ref_logps"] = rows["ref_logps"] * rows["mask"]
        if "values" in rows:
            rows["values"] = rows["values"] * rows["mask"]
        if "scores" not in rows:
            rows["scores"] = np.asarray([[self.score(p, r, m)] for p, r, m in zip(mine, rows["tokens"], rows["mask"])],
                                        np.float32)
        rows["scores"] = rows["scores"].astype(np.float32)
        if timings is not None:
            timings.update(rollout_s=done_sampling - started, scoring_s=time.perf_counter() - done_sampling)
        return rows

    def trainer_logps(self, variables, rows: dict[str, np.ndarray], block: tuple[int, int]) -> np.ndarray:
        """The log-probabilities [B, N] the trainer computes for the sampled tokens of this process's `rows`
        with its own `variables` (a full forward pass on its own mesh): what the sampler recorded, up to the
        numerics of a KV-cache decode against a forward pass, and of one mesh against another."""
        trainer_mesh = jax.tree.leaves(variables)[0].sharding.mesh
        sharding = batch_sharding(trainer_mesh)  # this process holds the same block of it (`_split_devices`)
        global_rows = len(rows["tokens"]) * block[1]
        if process_rows(sharding, global_rows) != block:
            raise ValueError(f"process {jax.process_index()} samples rows block {block} but trains block "
                             f"{process_rows(sharding, global_rows)}")
        layout = to_global({k: rows[k] for k in ("tokens", "segment_ids", "positions")}, sharding, global_rows)
        with jax.set_mesh(trainer_mesh):
            logps = _logps(self.graphdef, variables, layout["tokens"], layout["segment_ids"], layout["positions"],
                           prompt_len=rows_prompt_len(rows), temperature=self.settings.temperature)
        return to_local({"logps": logps}, sharding, block)["logps"]

    def read(self, arrays: dict, block: tuple[int, int]) -> dict[str, np.ndarray]:
        """Global arrays of rollout rows -> this process's block of them (numpy)."""
        return to_local(arrays, self.rows_sharding, block)

    def response_text(self, row_tokens: np.ndarray, mask: np.ndarray) -> str:
        """A rollout row's response as text, without the token it stopped at."""
        ids = row_tokens[len(row_tokens) - len(mask):][: int(mask.sum())]
        return self.tokenizer.decode([int(t) for t in ids if t not in self.stop_ids])

    def score(self, prompt: dict, row_tokens: np.ndarray, mask: np.ndarray) -> float:
        return float(self.reward_fn(prompt["prompt"], self.response_text(row_tokens, mask)))


def response_kl(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Each row's sampled-response KL to the reference [B], in nats: the sum over its tokens of log pi - log ref
    (the k1 estimator, unbiased for tokens drawn from the policy)."""
    return ((rows["old_logps"] - rows["ref_logps"]) * rows["mask"]).sum(axis=1)


def _encode(rows: dict[str, np.ndarray]) -> str:
    buffer = io.BytesIO()
    np.savez(buffer, **rows)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text))) as archive:
        return {k: archive[k] for k in archive.files}


class RolloutBatches:
    """The batch source of an RL objective (see the module doc): data index i is step i of iteration i // S, S
    the steps an iteration takes. Each process samples and keeps its own block of an iteration's rows
    (`request.rows`) and makes its minibatches from them alone: the rows are cut into as many strata as the
    batch mesh axes have shards (the same cut on one process or many), and each epoch's minibatch k takes its
    k-th slice of a seeded permutation of every stratum, so that devices train on the rows they sampled and
    no row travels between processes. Subclasses give `score(rows, variables)` (what the loss needs beyond
    the sampled rows; sums over all rows through `total`) and may keep state of their own across iterations
    (`extra_state`, restored by `restore_extra`)."""

    responses_per_prompt = 1

    def __init__(self, cfg: Config, settings: RolloutConfig, request: BatchRequest, sampler: Sampler,
                 prompts: list[dict]):
        tc = cfg.train
        self.samples = JsonlWriter(Path(cfg.workdir) / "samples.jsonl",
                                   enabled=bool(settings.samples_every and settings.samples)
                                   and jax.process_index() == 0)
        self.rows = settings.prompts_per_iteration * self.responses_per_prompt
        self.batch_size, self.seed, self.settings = tc.batch_size, tc.seed, settings
        self.kill_in_rollout = cfg.debug.kill_in_rollout or None
        self.steps_per_epoch = self.rows // tc.batch_size
        self.steps_per_iteration = settings.epochs * self.steps_per_epoch
        self.request, self.sampler, self.prompts = request, sampler, prompts
        self.block = sampler.block(self.rows)
        self.strata = cfg.mesh.batch_shards  # the trainer's: the same cut whichever devices sample
        self._check_blocks(settings)
        self.index, self.end = request.first, request.end
        self.iteration, self.buffer = None, None
        self.timings: dict = {}  # of the rollout made for the batch given last (none: empty)
        self.staleness, self.tis_cap = cfg.rl.max_staleness, cfg.rl.tis_cap
        self.ahead: RolloutAhead | None = None  # max_staleness=1: the next iteration's rollout
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "rollout") if self.staleness else None
        saved = request.state or {}
        self.restore_extra(saved)
        if "rollout" in saved and saved["iteration"] == self.index // self.steps_per_iteration:
            self.iteration, self.buffer = saved["iteration"], self._own_block(saved["rollout"])
        if "ahead" in saved:
            ahead = saved["ahead"]
            rows = self._own_block(ahead["rollout"])
            self.ahead = RolloutAhead(ahead["iteration"], rows=rows, trainer_logps=rows.pop("trainer_logps"))

    def _check_blocks(self, settings: RolloutConfig) -> None:
        """Each process's rows hold whole groups of responses, and minibatches cut evenly into strata."""
        section = "grpo" if self.responses_per_prompt > 1 else "ppo"
        index, count = self.block
        if self.block != self.request.rows:
            raise ConfigError("mesh", f"the rollout rows' block {self.block} of this process differs from its "
                                      f"train batches' {self.request.rows}")
        if settings.prompts_per_iteration % count:
            raise ConfigError(f"{section}.prompts_per_iteration", f"{settings.prompts_per_iteration} prompts do "
                              f"not split over the {count} processes that hold their own rows: use a multiple")
        if self.batch_size % self.strata or self.rows % self.strata:
            raise ConfigError("train.batch_size", f"{self.batch_size} rows a step and {self.rows} an iteration "
                              f"must split over the batch axes' {self.strata} shards")

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.index >= self.end:
            raise StopIteration
        iteration, cursor = divmod(self.index, self.steps_per_iteration)
        self.timings = {}
        if iteration != self.iteration:
            self.iteration, self.buffer = iteration, self._rows_of(iteration)
        epoch, k = divmod(cursor, self.steps_per_epoch)
        rows = self._minibatch(iteration, epoch, k)
        self.index += 1
        return {name: values[rows] for name, values in self.buffer.items()}

    def _minibatch(self, iteration: int, epoch: int, k: int) -> np.ndarray:
        """Indices into this process's block of the rows of minibatch k of an epoch (see the class doc)."""
        index, count = self.block
        per_stratum, take = self.rows // self.strata, self.batch_size // self.strata
        mine = self.strata // count
        picked = [np.random.default_rng([self.seed, iteration, epoch, index * mine + j]).permutation(per_stratum)
                  [k * take:(k + 1) * take] + j * per_stratum for j in range(mine)]
        return np.concatenate(picked)

    def _rows_of(self, iteration: int) -> dict[str, np.ndarray]:
        """The iteration's rows, ready for the loss: sampled now from the current weights (on-policy), or taken
        from the rollout sampled ahead (max_staleness=1), which then starts the next one."""
        current = self.request.current()
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.iteration == iteration:
            self.timings["rollout_wait_s"] = ahead.wait()
            self.timings.update(ahead.timings)
            rows, sampled_logps = ahead.rows, ahead.sampled_logps(self._trainer_logps, current)
        else:
            variables, self.timings["weight_sync_s"] = self.sampler.receive(current)
            rows = self._sample(iteration, variables, self.timings)
            sampled_logps = self._trainer_logps(current, rows)
        # The loop asks for data indices up to end - 2 (`end` leaves one past the last step): no rollout for
        # an iteration that will not train.
        if self.staleness and (iteration + 1) * self.steps_per_iteration < self.end - 1:
            variables, seconds = self.sampler.receive(current)
            self.timings["weight_sync_s"] = self.timings.get("weight_sync_s", 0.0) + seconds
            sample = functools.partial(self._sample, iteration + 1, variables)
            self.ahead = RolloutAhead.start(iteration + 1, self.request.trained(), sample, self.executor)
        return self._for_the_trainer(rows, sampled_logps, current)

    def _trainer_logps(self, variables, rows: dict[str, np.ndarray]) -> np.ndarray:
        """The trainer's log-probs of `rows` with `variables`, timed as `trainer_logps_s` (from when the update
        that made them is done)."""
        jax.block_until_ready(variables)
        started = time.perf_counter()
        logps = self.sampler.trainer_logps(variables, rows, self.block)
        self.timings["trainer_logps_s"] = self.timings.get("trainer_logps_s", 0.0) + time.perf_counter() - started
        return logps

    def _sample(self, iteration: int, variables, timings: dict) -> dict[str, np.ndarray]:
        """The iteration's scored rollouts from `variables` (on the sampler's devices; this process's block of
        the rows); `timings` gets the seconds they took. Runs in the rollout thread when sampled ahead."""
        G = self.responses_per_prompt
        order = np.random.default_rng([self.seed, iteration, 1 << 20]).permutation(len(self.prompts))
        chosen = [self.prompts[i] for i in np.resize(order, self.settings.prompts_per_iteration)]
        key = jax.random.fold_in(jax.random.key(self.seed), iteration)
        rows = self.sampler.respond(variables, [p for p in chosen for _ in range(G)], key, timings)
        if iteration == self.kill_in_rollout and jax.process_index() == jax.process_count() - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # debug.kill_in_rollout: a host lost mid-rollout
        tokens = float(self.total(rows["mask"].sum()))
        timings["rollout_tokens_per_sec"] = tokens / max(timings["rollout_s"], 1e-9)
        started = time.perf_counter()
        rows = self.score(rows, variables)  # host work on the rows: the sampler computed the critic's values
        timings["scoring_s"] += time.perf_counter() - started
        if self.settings.samples_every and iteration % self.settings.samples_every == 0:
            self._write_samples(iteration, chosen, rows)
        return rows

    def _for_the_trainer(self, rows: dict[str, np.ndarray], sampled_logps: np.ndarray, current) -> dict:
        """The rows with what the trainer adds (main thread): the log-prob mismatch (`sampled_logps`, the
        trainer's log-probs with the weights that sampled); under max_staleness=1 the ratio's old log-probs,
        the trainer's with the weights the iteration starts with; with rl.tis_cap the truncated importance
        weights min(exp(old - recorded), tis_cap) of the behaviour policy (the recorded log-probs; on-policy
        "old" is the trainer's recompute of them, so the weights correct the sampler-trainer gap alone)."""
        self.timings.update(self._mismatch(sampled_logps, rows))
        mask, recorded = rows["mask"], rows["old_logps"]
        proximal = self._trainer_logps(current, rows) * mask if self.staleness else sampled_logps * mask
        rows = {**rows, "old_logps": proximal.astype(np.float32) if self.staleness else recorded}
        if self.tis_cap:
            rows["tis_weights"] = (np.minimum(np.exp(proximal - recorded), self.tis_cap) * mask).astype(np.float32)
        return rows

    def _mismatch(self, sampled_logps: np.ndarray, rows: dict[str, np.ndarray]) -> dict[str, float]:
        """How far the log-probabilities recorded at sampling are from `sampled_logps`, those the trainer
        computes for the same tokens with the same weights: the mean and the largest absolute difference over
        every process's valid response tokens (verl's rollout-vs-trainer mismatch)."""
        gap = np.abs(sampled_logps - rows["old_logps"]) * rows["mask"]
        summed, tokens = self.total([gap.sum(), rows["mask"].sum()])
        largest = float(per_block(np.float64(gap.max(initial=0.0)), self.block).max())
        return {"logp_mismatch_mean": float(summed / max(tokens, 1.0)), "logp_mismatch_max": largest}

    def total(self, values) -> np.ndarray:
        """`values` summed over every process's block (a collective: all processes call it together)."""
        return sum_over_blocks(values, self.block)

    def score(self, rows: dict[str, np.ndarray], variables) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _write_samples(self, iteration: int, chosen: list[dict], rows: dict[str, np.ndarray]) -> None:
        """The first response to each of the first `samples` prompts of the iteration: each process makes those
        in its block, process 0 writes them all (a collective)."""
        first = self.block[0] * len(rows["mask"])
        mine = []
        for i, prompt in enumerate(chosen[: self.settings.samples]):
            r = i * self.responses_per_prompt - first
            if 0 <= r < len(rows["mask"]):
                mine.append({"iteration": iteration, "prompt": prompt["prompt"],
                             "response": self.sampler.response_text(rows["tokens"][r], rows["mask"][r]),
                             "reward": float(rows["scores"][r, 0])})
        for text in texts_per_block(json.dumps(mine), self.block):
            for record in json.loads(text):
                self.samples.write(record)

    def step_metrics(self) -> dict:
        """Host metrics of the batch given last (jaxllm.train.fit.host_metrics), at an iteration's first step:
        the seconds its rollouts took to sample (`rollout_s`; one step off, in the rollout thread, and
        `rollout_wait_s` the trainer's wait for them) and to score (`scoring_s`: reference, reward, critic), the
        weight sync (`weight_sync_s`), the trainer's log-probs of the rows (`trainer_logps_s`), the sampler's
        tokens/s (all processes' tokens) and the log-prob mismatch; 0 at the other steps, so that sums over
        steps split the run's time."""
        return {"rollout_s": 0.0, "scoring_s": 0.0, "weight_sync_s": 0.0, "trainer_logps_s": 0.0, **self.timings}

    def extra_state(self) -> dict:
        return {}

    def restore_extra(self, saved: dict) -> None:
        pass

    def get_state(self) -> dict:
        """The position, the iteration's rows, and under max_staleness=1 the next iteration's (waiting for them,
        with the trainer's log-probs of them): every block, in order (a collective; the state is written once,
        by process 0, and a resume on any number of processes takes its own block of them)."""
        state = {"step": self.index, "iteration": self.iteration}
        if self.ahead is not None:
            logps = self.ahead.sampled_logps(self._trainer_logps, self.request.current())
            rows = {**self.ahead.rows, "trainer_logps": logps}
            state["ahead"] = {"iteration": self.ahead.iteration,
                              "rollout": texts_per_block(_encode(rows), self.block)}
        state.update(self.extra_state())  # after the rollout in flight: it may move them (PPO's KL coefficient)
        if self.buffer is None:
            return state
        return {**state, "rollout": texts_per_block(_encode(self.buffer), self.block)}

    def _own_block(self, saved: str | list[str]) -> dict[str, np.ndarray]:
        """This process's block of a saved iteration's rows (saved by any number of processes)."""
        blocks = [_decode(text) for text in ([saved] if isinstance(saved, str) else saved)]
        rows = {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]}
        index, count = self.block
        size = self.rows // count
        return {name: values[index * size:(index + 1) * size] for name, values in rows.items()}

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        self.samples.close()


def held_out_report(sampler: Sampler, variables, prompts: list[dict], key, section: str) -> dict:
    """The held-out report of `prompts`: one response each, sampled like the rollouts; the prompts are padded
    with repeats to a whole number of rows per batch shard, and only the real ones count. Samples: the first
    three of this process's block (process 0 holds the first prompts)."""
    shards = row_shards(sampler.rows_sharding)
    padded = prompts + prompts[:1] * (-len(prompts) % shards)
    rows = sampler.respond(variables, padded, key)
    index, count = sampler.block(len(padded))
    first = index * len(rows["mask"])
    real = (first + np.arange(len(rows["mask"]))) < len(prompts)
    per_row = np.stack([rows["scores"][:, 0], response_kl(rows), rows["stopped"][:, 0], rows["mask"].sum(axis=1)])
    reward, kl, eos_rate, length = sum_over_blocks((per_row * real).sum(axis=1), (index, count)) / len(prompts)
    mine = prompts[first:first + int(real.sum())][:3]
    samples = [{"task": section, "reference": p["prompt"][-60:], "response": sampler.response_text(r, mask)}
               for p, r, mask in zip(mine, rows["tokens"], rows["mask"])]
    return {"scores": {"all": {"examples": len(prompts), "reward": float(reward), "kl": float(kl),
                               "eos_rate": float(eos_rate), "length": float(length)}}, "samples": samples}


def frozen_reference(base, plain: Objective, mesh):
    """Full fine-tuning's reference (lora.rank=0): the base's weights as the plain LM's, loaded once onto the
    rollout devices' `mesh` and never updated; the trainer's devices hold only the weights that train."""
    abstract = jax.eval_shape(lambda: plain.split(plain.build_model(jax.random.key(0)))[1])
    with jax.set_mesh(mesh):
        return load_base(base, abstract, mesh)[0]


@dataclasses.dataclass(frozen=True)
class RLSetup:
    """What an RL objective is built from: the base, the plain LM and the policy objectives, the sampler, the
    prompts ({"train", "eval"}) and the held-out report."""

    base: object
    plain: Objective
    policy: Objective
    sampler: Sampler
    prompts: dict
    report: object


def rl_setup(cfg: Config, section: str, log, build_policy=lm_objective, value_fn=None) -> RLSetup:
    """Locate the base, resolve the reward, read the prompts and build the sampler of `cfg.<section>`;
    `build_policy(model, precision, pipeline, lora, rope_scaling=..., sequence_parallel=...)` gives the
    policy's objective."""
    base = locate_base(cfg, section)
    if cfg != rollout_rows(cfg, section):
        raise ConfigError("train.seq_len", f"{section.upper()} rows are sized before the objective is built "
                                           "(jaxllm.launch.train.resolve): resolve the config first")
    if base is None:
        raise ConfigError("checkpoint.restore_from", f"{section.upper()} starts from a model, its reference: name "
                                                     "a jaxllm run or a Hugging Face model directory")
    settings: RolloutConfig = getattr(cfg, section)
    own = rollout_mesh(cfg)  # rl.placement=disaggregated: the rollout devices' own mesh
    mesh = own or run_mesh(cfg)
    if settings.reward.startswith("rm:"):
        reward_fn = load_reward_model(settings.reward, mesh, cfg.precision.compute, cfg.model.vocab_size,
                                      f"{section}.reward")
    else:
        try:
            reward_fn = rewards.resolve(settings.reward)
        except ValueError as exc:
            raise ConfigError(f"{section}.reward", str(exc)) from None
    tokenizer = load_tokenizer(tokenizer_path(cfg, base, section))
    with data_errors(section):
        prompts = read_prompts(settings.train_file, settings.eval_file, settings.eval_fraction, cfg.train.seed,
                               tokenizer, settings.template, settings.max_prompt_tokens, log)
    if not prompts["train"]:
        raise ConfigError(f"{section}.train_file", f"no usable prompts in {settings.train_file}")
    rope = base.rope_scaling
    sp = cfg.mesh.sequence_parallel
    plain = lm_objective(cfg.model, cfg.precision, cfg.pipeline, adapters_off(cfg.lora), rope_scaling=rope,
                         sequence_parallel=sp)
    policy = build_policy(cfg.model, cfg.precision, cfg.pipeline, cfg.lora, rope_scaling=rope, sequence_parallel=sp)
    reference = frozen_reference(base, plain, own) if not cfg.lora.rank else None
    sampler = Sampler(policy.graphdef, plain.graphdef, mesh, tokenizer, reward_fn, settings,
                      stop_ids(settings.template, tokenizer), WeightSync(own) if own is not None else None,
                      reference=reference, value_fn=value_fn)
    held_out = prompts["eval"][: settings.eval_prompts]

    def report(graphdef, variables, mesh):
        """Held-out mean reward, per-response KL to the reference (nats), EOS rate and length."""
        if not held_out:
            return {"scores": {}, "samples": []}
        key = jax.random.key(cfg.train.seed + 1)
        return held_out_report(sampler, sampler.receive(variables)[0], held_out, key, section)

    return RLSetup(base, plain, policy, sampler, prompts, with_sft_task(report, base, cfg.train.batch_size, log))


def rl_objective(setup: RLSetup, name: str, loss_fn, open_batches, progress_metrics: tuple[str, ...]) -> Objective:
    """The RL objective: the policy's model with `loss_fn`, batches from `open_batches(request)`, no held-out
    loss (the task report measures it)."""
    return dataclasses.replace(setup.policy, name=name, loss_fn=loss_fn, open_batches=open_batches,
                               eval_batches=None, tokenizer=setup.sampler.tokenizer, sample_prompt=None,
                               base=setup.base, report=setup.report, progress_metrics=progress_metrics)
