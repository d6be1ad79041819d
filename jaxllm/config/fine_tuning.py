"""The config sections of the objectives that fine-tune a base (train.objective sft, reward, dpo, grpo, ppo):
their data (SFT examples, preference pairs, RL prompts), losses and sampling, each with its own `check()`, and
`OBJECTIVE_CHECKS`, what `jaxllm.config.schema.validate` checks of them for the objective that trains.

They are config (typed values the `--config.sft.*`, `--config.dpo.*`, ... keys set), so they live in the config
package, below the objectives that read them; `jaxllm.objectives.registry` builds each objective named here.
The LoRA section is the model's (jaxllm.config.schema.LoRAConfig): these checks need only its rank.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxllm.config.typed_config import ConfigError, check_choice, check_positive

OBJECTIVES = ("pretrain", "sft", "reward", "dpo", "grpo", "ppo")
DPO_LOSSES = ("sigmoid", "ipo", "robust")
DPO_REFERENCES = ("shared", "precomputed")
GRPO_LOSS_AGGS = ("dapo", "grpo", "bnpo", "dr_grpo")  # GRPO's loss aggregations (jaxllm.objectives.losses)
KL_ESTIMATORS = ("k1", "k2", "k3")  # per-token KL estimators (jaxllm.objectives.losses.kl_penalty)
SFT_TEMPLATES = ("alpaca", "chatml", "model")
OVERLONG_RULES = ("truncate", "drop")
RL_PLACEMENTS = ("colocated", "disaggregated")


@dataclasses.dataclass(frozen=True)
class TextFiles:
    """The fields of every fine-tuning objective's text data (see each section): JSON-lines files, the held-out
    fraction, the template and the tokenizer."""

    train_file: str = ""
    eval_file: str = ""
    eval_fraction: float = 0.05
    template: str = "alpaca"
    tokenizer: str = ""

    def check_files(self, section: str, what: str) -> None:
        """These fields, for the config section `section` of `what` (examples, preference pairs, prompts)."""
        if not self.train_file:  # the files themselves are opened when the run starts (a dry run needs none)
            raise ConfigError(f"{section}.train_file", f"must name a JSON-lines file of {what}")
        if not self.eval_file and not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"{section}.eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")
        check_choice(f"{section}.template", self.template, SFT_TEMPLATES)


@dataclasses.dataclass(frozen=True)
class FineTuningData(TextFiles):
    """The data fields SFT and preference learning share: the text files, and the rule for an example too long."""

    overlong: str = "truncate"

    def check_data(self, section: str, what: str) -> None:
        """The data fields, for the config section `section` of `what` (examples, preference pairs)."""
        self.check_files(section, what)
        check_choice(f"{section}.overlong", self.overlong, OVERLONG_RULES)


@dataclasses.dataclass(frozen=True)
class SFTConfig(FineTuningData):
    """Supervised fine-tuning data (train.objective="sft"), prepared into `data.path` at the start of the run
    (skipped when it is up to date).

    `train_file` / `eval_file`: JSON lines of {"prompt", "response"} or {"messages": [{"role", "content"}...]}
    (an optional "task" names the group an example's metrics are reported in); no `eval_file`: a seeded
    `eval_fraction` of the train file is held out. `template` renders examples as tokens (jaxllm/data/sft.py):
    "alpaca", "chatml" or "model" (the base tokenizer's own chat_template, rendered by transformers). An
    example longer than train.seq_len + 1 tokens is cut (`overlong`="truncate") or left out ("drop"); either
    is counted. `tokenizer`: the base model's tokenizer file ("" = found from checkpoint.restore_from).
    `eval_examples` held-out examples are generated (greedy, up to `max_new_tokens`) for exact-match accuracy and
    BLEU, before and after training."""

    eval_examples: int = 200
    max_new_tokens: int = 32

    def check(self) -> None:
        self.check_data("sft", "examples")
        if self.eval_examples < 0:
            raise ConfigError("sft.eval_examples", f"must be >= 0, got {self.eval_examples}")
        check_positive("sft.max_new_tokens", self.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class PreferenceConfig(FineTuningData):
    """Preference pairs (train.objective "reward" or "dpo"), prepared into `data.path` at the start of the run
    (jaxllm/data/preference.py; skipped when up to date).

    `train_file` / `eval_file`: JSON lines of {"prompt", "chosen", "rejected"} (strings), or the chat form with a
    `prompt` list of messages and `chosen` / `rejected` as assistant messages; an optional "kind" (str) names the
    group a pair's accuracy is reported in. No `eval_file`: a seeded `eval_fraction` is held out. `template`,
    `tokenizer` as in SFTConfig. A pair's two sequences share one row of train.seq_len positions (up to
    `pairs_per_row` pairs a row); a sequence longer than half a row is cut (`overlong`="truncate") or its pair
    left out ("drop"). `eval_pairs` held-out pairs (0: all) are scored per kind before and after training."""

    pairs_per_row: int = 4
    eval_pairs: int = 0

    def check(self) -> None:
        self.check_data("preference", "preference pairs")
        check_positive("preference.pairs_per_row", self.pairs_per_row)
        if self.eval_pairs < 0:
            raise ConfigError("preference.eval_pairs", f"must be >= 0 (0: all), got {self.eval_pairs}")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward model's Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) + center_coef *
    (r_chosen + r_rejected)^2 per pair (TRL's RewardTrainer; `margin` is a constant here)."""

    margin: float = 0.0
    center_coef: float = 0.0


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimisation (jaxllm.objectives.losses.dpo_loss): `loss` "sigmoid", "ipo" or "robust",
    `beta`, `label_smoothing` (robust; with sigmoid it gives conservative DPO, which TRL 1.13.0's sigmoid
    ignores). `reference` "shared": the reference is the base with the adapters off (the same arrays, no copy;
    needs lora.rank > 0); "precomputed": the base scores every pair once before training and the sums are stored
    with the data (jaxllm/objectives/reference.py): no reference model in memory, for full fine-tuning too.
    `rpo_alpha` > 0 adds that weight times the chosen responses' negative log-likelihood per token (RPO; TRL
    1.13.0's loss_type ["sigmoid", "sft"] with loss_weights [1, rpo_alpha]): a guard against DPO lowering the
    likelihood of the very responses it prefers."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "shared"
    rpo_alpha: float = 0.0

    def check(self, lora_rank: int) -> None:
        """This section's fields, and the reference against the LoRA rank the run trains (lora.rank)."""
        check_positive("dpo.beta", self.beta)
        check_choice("dpo.loss", self.loss, DPO_LOSSES)
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError("dpo.label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        check_choice("dpo.reference", self.reference, DPO_REFERENCES)
        if self.rpo_alpha < 0:
            raise ConfigError("dpo.rpo_alpha", f"must be >= 0, got {self.rpo_alpha}")
        if self.reference == "shared" and not lora_rank:
            raise ConfigError("dpo.reference", "'shared' (the base with adapters off) needs LoRA adapters "
                                               "(lora.rank > 0)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(TextFiles):
    """What PPO and GRPO share: prompts, sampling, and the held-out report.

    Prompts: `train_file` / `eval_file` JSON lines of {"prompt"} or {"messages"} ending with a user turn
    (jaxllm/data/prompts.py; no `eval_file`: a seeded `eval_fraction` is held out), rendered with `template`,
    at most `max_prompt_tokens` tokens (longer ones are left out and counted); `tokenizer` as in SFTConfig.
    Each iteration takes `prompts_per_iteration` prompts and samples responses to them with the current policy
    (up to `max_new_tokens`, at `temperature`, stopping where a turn ends: EOS, or the template's end-of-turn
    token, jaxllm.data.sft_template.stop_ids), scored by `reward` ("fn:<name>",
    jaxllm/objectives/reward_fns.py; "rm:<checkpoint>" of a reward-model run); it then trains `epochs` passes over them
    in minibatches of train.batch_size rows, one optimizer step each. `clip` is the policy ratio's clip range.
    `eval_prompts` held-out prompts are answered (same sampling, fixed seed) and scored before and after
    training. Every `samples_every` iterations (0: never) `samples` of the iteration's prompts with their
    responses and rewards are appended to <workdir>/samples.jsonl. `decode_slots` > 0 samples through that many
    KV-cache rows, each refilled with the next prompt once its response ends (continuous batching,
    jaxllm/model/continuous.py: less cache and no decoding past a row's end, for responses of uneven length);
    0 decodes every response at once until the longest ends. Either way each prompt's response is the same draw
    for a given seed whatever the slots (with decode_slots > 0; 0 draws otherwise)."""

    reward: str = ""
    max_prompt_tokens: int = 64
    max_new_tokens: int = 32
    prompts_per_iteration: int = 8
    epochs: int = 1
    temperature: float = 1.0
    clip: float = 0.2
    eval_prompts: int = 32
    samples_every: int = 10
    samples: int = 3
    decode_slots: int = 0

    def check_rollout(self, section: str, lora_rank: int, batch_size: int, rows: int) -> None:
        """The checks PPO and GRPO share, for config section `section`; `rows` are an iteration's responses,
        trained in minibatches of `batch_size`, with adapters of rank `lora_rank` or every weight (0: GRPO's
        own check says where its reference lives); whether an rm: reward exists: `probe_environment`."""
        self.check_files(section, "prompts")
        kind, _, name = self.reward.partition(":")
        if kind not in ("fn", "rm") or not name:
            raise ConfigError(f"{section}.reward", f"expected fn:<name> (jaxllm/objectives/reward_fns.py) or "
                                                   f"rm:<reward-model checkpoint>, got {self.reward!r}")
        for key in ("max_prompt_tokens", "max_new_tokens", "prompts_per_iteration", "epochs", "temperature", "clip"):
            check_positive(f"{section}.{key}", getattr(self, key))
        if rows % batch_size:
            raise ConfigError("train.batch_size", f"{batch_size} does not divide an iteration's {rows} responses")
        for key in ("eval_prompts", "samples_every", "samples"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{section}.{key}", f"must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.decode_slots <= rows:
            raise ConfigError(f"{section}.decode_slots", f"must be in [0, {rows}] (0: every response at once; at "
                                                         f"most an iteration's responses), got {self.decode_slots}")


    def probe_reward_model(self, section: str) -> None:
        """An rm: reward names a checkpoint that exists (jaxllm.config.schema.probe_environment: it lies outside
        the config)."""
        kind, _, name = self.reward.partition(":")
        if kind == "rm" and not Path(name).exists():
            raise ConfigError(f"{section}.reward", f"no reward-model checkpoint at {name}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(RolloutConfig):
    """Group relative policy optimisation (train.objective="grpo", jaxllm/objectives/grpo.py), with the rollout
    settings of RolloutConfig: `num_generations` responses to each prompt, so an iteration is
    epochs * prompts_per_iteration * num_generations / train.batch_size optimizer steps. Loss:
    jaxllm.objectives.losses.grpo_loss with `beta` (the k3 KL to the reference, the base with the adapters off), `clip`
    and `loss_agg`."""

    num_generations: int = 4
    beta: float = 0.04
    loss_agg: str = "dapo"

    def check(self, lora_rank: int, batch_size: int, rl: RLConfig | None = None) -> None:
        """This section's fields; with `lora.rank=0` (every weight trains) the frozen reference lives on the
        rollout devices, so `rl` must disaggregate."""
        if not lora_rank and not (rl is not None and rl.disaggregated):
            raise ConfigError("lora.rank", "full fine-tuning GRPO (lora.rank=0) keeps its frozen reference on the "
                                           "rollout devices: set rl.placement=disaggregated and rl.rollout_devices")
        if self.num_generations < 2:
            raise ConfigError("grpo.num_generations", f"must be >= 2 (advantages compare a group), got "
                                                      f"{self.num_generations}")
        self.check_rollout("grpo", lora_rank, batch_size, self.prompts_per_iteration * self.num_generations)
        if self.beta < 0:
            raise ConfigError("grpo.beta", f"must be >= 0, got {self.beta}")
        check_choice("grpo.loss_agg", self.loss_agg, GRPO_LOSS_AGGS)


@dataclasses.dataclass(frozen=True)
class PPOConfig(RolloutConfig):
    """Proximal policy optimisation with a critic (train.objective="ppo", jaxllm/objectives/ppo.py), with the rollout
    settings of RolloutConfig: one response to each prompt, so an iteration is
    epochs * prompts_per_iteration / train.batch_size optimizer steps.

    Per-token rewards: -kl_coef * kl_t (`kl_estimator` k1, k2 or k3 of the sampler's against the reference's
    log-probs), plus the score at the response's last token, less `missing_eos_penalty` when it did not stop
    (no EOS, nor the template's end-of-turn token).
    `target_kl` > 0 adapts kl_coef toward that per-response KL (Ziegler et al.'s proportional controller, over
    `kl_horizon` responses); 0 keeps it fixed. Advantages: GAE with `gamma` and `lam`, whitened over valid
    tokens. Loss: the clipped policy loss (`clip`), `vf_coef` x the clipped value loss (`value_clip`), less
    `entropy_coef` x the mean entropy. An update whose minibatch's approximate KL to the sampling policy passes
    `max_approx_kl` (0: never) is skipped, which stops the iteration's updates while the policy is that far.
    `critic_init` "" (the default): the critic is the policy's base with adapters of its own and a fresh scalar
    head. "rm:<checkpoint>" of a reward-model run (train.objective=reward, LoRA or not): the critic starts as that
    reward model, its body (adapters merged) frozen with the critic's adapters on it and its score head trained
    on; the critic then holds a body of its own beside the policy's base. Under full fine-tuning (lora.rank=0)
    the critic is a model of its own, every weight trained: a copy of the base with a fresh head, or the reward
    model whole."""

    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    target_kl: float = 0.0
    kl_horizon: int = 10000
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    missing_eos_penalty: float = 0.0
    max_approx_kl: float = 0.0
    critic_init: str = ""

    def check(self, lora_rank: int, batch_size: int, rl: RLConfig | None = None) -> None:
        """This section's fields; with `lora.rank=0` (every weight trains, the critic's body of its own too) the
        frozen reference lives on the rollout devices, so `rl` must disaggregate."""
        if not lora_rank and not (rl is not None and rl.disaggregated):
            raise ConfigError("lora.rank", "full fine-tuning PPO (lora.rank=0) keeps its frozen reference on the "
                                           "rollout devices: set rl.placement=disaggregated and rl.rollout_devices")
        self.check_rollout("ppo", lora_rank, batch_size, self.prompts_per_iteration)
        check_choice("ppo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for key in ("kl_coef", "target_kl", "vf_coef", "entropy_coef", "missing_eos_penalty", "max_approx_kl"):
            if getattr(self, key) < 0:
                raise ConfigError(f"ppo.{key}", f"must be >= 0, got {getattr(self, key)}")
        for key in ("kl_horizon", "value_clip"):
            check_positive(f"ppo.{key}", getattr(self, key))
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"ppo.{key}", f"must be in [0, 1], got {getattr(self, key)}")
        if self.critic_init and not (self.critic_init.startswith("rm:") and len(self.critic_init) > 3):
            raise ConfigError("ppo.critic_init", f"expected \"\" (a fresh head on the policy's base) or "
                                                 f"rm:<reward-model checkpoint>, got {self.critic_init!r}")

    def probe_reward_model(self, section: str) -> None:
        """The reward model and the critic's reward model exist (see RolloutConfig.probe_reward_model)."""
        super().probe_reward_model(section)
        if self.critic_init and not Path(self.critic_init[len("rm:"):]).exists():
            raise ConfigError("ppo.critic_init", f"no reward-model checkpoint at {self.critic_init[len('rm:'):]}")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Where PPO's and GRPO's rollouts run (docs/rl-at-scale.md).

    `placement` "colocated": the run's devices sample and train, time-shared, from the same arrays.
    "disaggregated": `rollout_devices` devices (the last ones of every process alike, so it must split over
    the processes) sample, score and hold the reference (and a reward model), on a mesh of their own that splits
    rows only (`data`); the mesh axes' product is the device count less them. After each iteration's updates the
    policy's trained variables reach them by resharding (`jax.device_put`, through the hosts across processes;
    the frozen base is copied once), timed as `weight_sync_s`.

    `max_staleness` 0: on-policy, each iteration samples from the weights it starts with. 1 (disaggregated
    only): one step off, the rollouts of iteration k + 1 are sampled from iteration k's starting weights while
    iteration k trains; the ratio's "old" log-probs are then the trainer's own at the iteration's start, and
    `tis_cap` > 0 weighs each token's policy loss by the truncated importance weight
    min(exp(old - behaviour), tis_cap), behaviour being the log-probs recorded at sampling (verl's TIS; it
    also corrects the sampler-trainer gap on-policy). 0: no weight."""

    placement: str = "colocated"
    rollout_devices: int = 0
    max_staleness: int = 0
    tis_cap: float = 0.0

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def check(self) -> None:
        check_choice("rl.placement", self.placement, RL_PLACEMENTS)
        if self.disaggregated and self.rollout_devices < 1:
            raise ConfigError("rl.rollout_devices", f"rl.placement=disaggregated needs devices of its own for the "
                                                    f"rollouts (>= 1), got {self.rollout_devices}")
        if not self.disaggregated and self.rollout_devices:
            raise ConfigError("rl.rollout_devices", f"sets devices aside for rl.placement=disaggregated; with "
                                                    f"{self.placement!r} it must be 0, got {self.rollout_devices}")
        if self.max_staleness not in (0, 1):
            raise ConfigError("rl.max_staleness", f"must be 0 (on-policy) or 1 (one step off), got "
                                                  f"{self.max_staleness}")
        if self.max_staleness and not self.disaggregated:
            raise ConfigError("rl.max_staleness", "1 samples while training: it needs rollout devices of their own "
                                                  "(rl.placement=disaggregated)")
        if not self.tis_cap >= 0:
            raise ConfigError("rl.tis_cap", f"must be >= 0 (0: off), got {self.tis_cap}")

    def set_aside(self, objective: str) -> int:
        """The devices this run's rollouts take from the mesh (0 unless an RL objective disaggregates)."""
        return self.rollout_devices if objective in ("grpo", "ppo") and self.disaggregated else 0


# The sections each objective reads besides the core ones (jaxllm.config.schema), checked only for the objective
# that trains (they need the LoRA rank and the batch size). jaxllm.objectives.registry builds the objectives these
# names; tests/test_architecture.py holds the two tables to the same names.
OBJECTIVE_CHECKS = {
    "pretrain": lambda cfg: None,
    "sft": lambda cfg: cfg.sft.check(),
    "reward": lambda cfg: cfg.preference.check(),
    "dpo": lambda cfg: (cfg.preference.check(), cfg.dpo.check(cfg.lora.rank)),
    "grpo": lambda cfg: cfg.grpo.check(cfg.lora.rank, cfg.train.batch_size, cfg.rl),
    "ppo": lambda cfg: cfg.ppo.check(cfg.lora.rank, cfg.train.batch_size, cfg.rl),
}
