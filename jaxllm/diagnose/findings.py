"""The diagnosis rules: each turns a run's records into at most one Finding (id, severity, evidence, action).

A rule raises NotEvaluated when its evidence is missing (a field an older run does not log, a config value it
needs, a device whose peak is unknown): the report lists it with the reason rather than guessing. Every number a
rule compares against is a field of THRESHOLDS (documented in docs/diagnostics.md, Diagnosis report), calibrated on
real runs of the default job and its seeded pathologies (scripts/seeded_pathologies.py) where the fields exist,
and on published magnitudes otherwise (noted per field).

Ids are short and stable: tests and tools read them from findings.json.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable

import numpy as np

from jaxllm.diagnose.run_data import RunData
from jaxllm.diagnose.signals import LossShape, loss_shape, running_median, trailing_ratio
from jaxllm.objectives.registry import LOSS_KINDS, OBJECTIVES

CRITICAL, WARNING, INFO = "critical", "warning", "info"


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Every limit the rules compare against (docs/diagnostics.md, Diagnosis report, has the table with the reasons)."""

    smooth_window: int = 5  # steps in the running median that removes batch noise from the loss ...
    pair_smooth_share: float = 0.1  # ... or this share of the run's steps for a mean over a few pairs (LOSS_KINDS)
    min_steps: int = 10  # fewer step records: the loss rules are not evaluated
    divergence_rise: float = 0.10  # smoothed loss ends this fraction above its minimum ...
    # ... or this many times its step-to-step wobble: the lowest point of a noisy smoothed loss is itself a low draw
    # of its noise (a healthy DPO run at batch 16: a 23% wobble, its end 51% above that low)
    divergence_wobbles: float = 3.0
    excursion: float = 0.03  # the smoothed loss climbs this fraction above its lowest point so far ...
    # ... or, where the run's loss is noisier, this many times its own wobble (below): a small batch's loss
    # climbs a few % for a few steps in healthy runs (the default job, five seeds of 300 steps: 5.0-6.9% at a
    # wobble of 1.7-2.2%, 2.6-3.9 times it)
    excursion_wobbles: float = 6.0
    # median step-to-step loss change after warmup, fraction of the smoothed loss; judged for token-mean losses
    # only (a loss over a few pairs a step changes by tens of percent with its batch: registry.LOSS_KINDS)
    oscillation: float = 0.06
    # median |update| / |param| per step. AdamW moves each weight by about lr * |m / sqrt(v)|, so the ratio
    # follows the LR: the default job measured 2e-2 after warmup (lr 3e-3), 6e-2..0.16 at LR x30, 4e-5 at LR/1000
    # (larger models at lr ~3e-4 run near 1e-3).
    large_update_ratio: float = 5e-2  # over the steps where the loss climbed
    tiny_update_ratio: float = 1e-4
    min_progress: float = 0.05  # a run from scratch whose smoothed loss fell less than this fraction is slow
    initial_loss_ratio: float = 2.0  # the first loss over ln(vocab_size), a uniform guess's loss
    logits_max: float = 50.0  # diag/logits_max: output logits this large make the softmax one-hot
    grad_spike_ratio: float = 10.0  # gradient norm this many times the median of the 10 steps before it
    grad_spike_share: float = 0.10  # spikes on more than this share of steps
    # the gradient norm's running median (over a tenth of the run, at least 9 steps) grows this many times above
    # its low: healthy runs grow 1.1-5.9x (LoRA SFT's adapters start at zero; a reward model's gradient follows its
    # loss toward zero and back with the hard pairs)
    grad_growth: float = 10.0
    grad_level_share: float = 0.1
    clip_share: float = 0.5  # share of post-warmup steps whose gradient norm exceeds optim.clip_norm
    layer_outlier: float = 10.0  # a layer's norm below 1/x or above x times the median of the other layers ...
    # ... and for its gradient norm, which spreads across depth more (healthy: 0.09-8.9x the others'; AdamW's
    # update is normalised, so the update ratio is what shows a layer that does not learn)
    layer_grad_outlier: float = 20.0
    vanishing_ratio: float = 0.01  # a layer's gradient norm below this fraction of the largest layer's
    gate_saturation: float = 0.25  # fraction of a layer's SwiGLU gate inputs in silu's flat tails
    # A mixture of experts' busiest k experts' share of the picks (median of the last third of the steps), as the
    # fraction of the way from even (k/E) to every token on the same k experts (1); with 8 experts, top 2: a share
    # of 0.81. Measured on the shipped corpus: every router collapses early (0.8-1.0 around step 30, as the residual
    # stream's shared direction grows) and spreads again. Healthy: configs/pretrain_moe.py's 300 steps end at
    # 0.33-0.74 per layer (aux loss 0.01) and 0.36-0.66 (0.1); moe_tiny's 200 steps at 0.42-0.55. Collapsed, a hot
    # router (debug.router_scale=1000, saturated, no aux loss): pretrain_moe's worst layer 0.98, moe_tiny's 0.88.
    expert_concentration: float = 0.75
    # Attention logits: healthy runs of the shipped jobs' tiny models reach 54-75 (pretraining, five seeds; SFT 70)
    # and DPO from the SFT model up to 127; they level off after their early growth. The seeded init_std x50 and
    # LR x30 runs: 1.2e3-1.2e4.
    attn_logit_max: float = 200.0  # the largest max attention logit of a layer at the run's end ...
    attn_logit_floor: float = 50.0  # ... or above this and still growing at the end:
    attn_logit_growth: float = 2.0  # this many times the median of its middle third of records
    data_wait_share: float = 0.20  # share of step time spent waiting for the next batch
    low_mfu: float = 0.20  # median MFU below this (only where the device's peak FLOP/s is known)
    checkpoint_share: float = 0.10  # share of training wall time blocked by checkpoint saves
    memory_used: float = 0.90  # per-device bytes over the device's limit
    overflow_share: float = 0.05  # float16: share of steps whose gradients overflowed


THRESHOLDS = Thresholds()


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing a person can act on. `evidence` holds `summary` (a plain sentence) and the steps, layers and
    values it rests on."""

    id: str
    severity: str
    evidence: dict
    action: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class NotEvaluated(Exception):
    """A rule's evidence is missing; the message says what and why."""


Rule = Callable[[RunData, Thresholds], "Finding | None"]


def required_series(run: RunData, name: str) -> np.ndarray:
    """The step field `name`; NotEvaluated when the run did not log it."""
    values = run.series(name)
    if values is None:
        raise NotEvaluated(f"metrics.jsonl has no `{name}` (an older run, or not logged by this objective)")
    return values


@dataclasses.dataclass(frozen=True)
class JudgedLoss:
    """A run's LossShape and the limits its own noise and kind of loss allow: the smoothed loss may end `rise`
    above its low and climb `excursion` above a low on the way, and change by `wobble` from step to step
    (inf: not judged for this kind of loss)."""

    shape: LossShape
    rise: float
    excursion: float
    wobble: float

    def unstable(self, rise: float | None = None, excursion: float | None = None) -> bool:
        """The loss went non-finite, ended above its low, climbed back up somewhere, or wobbles, past its limits
        (or the `rise` and `excursion` given)."""
        s = self.shape
        return (bool(s.nonfinite_steps) or s.rise > (rise or self.rise) or s.excursion > (excursion or self.excursion)
                or s.wobble > self.wobble)


def loss_kind(run: RunData) -> str:
    """What the run's logged loss measures (registry.LOSS_KINDS), from its objective."""
    spec = OBJECTIVES.get(run.config_value("train.objective", "pretrain"))
    return spec.loss_kind if spec else "token_mean"


def _judged_loss(run: RunData, t: Thresholds) -> JudgedLoss:
    kind = loss_kind(run)
    if kind == "surrogate":
        raise NotEvaluated(f"the {run.config_value('train.objective')} loss is {LOSS_KINDS[kind]}")
    loss = required_series(run, "loss")
    if len(loss) < t.min_steps:
        raise NotEvaluated(f"only {len(loss)} step records (the loss rules need {t.min_steps})")
    if not np.any(np.isfinite(loss)):
        shape = LossShape(loss, 0, np.inf, np.inf, 0, 0, 0.0, 0.0, [int(s) for s in run.step])
    else:
        # a few pairs' mean is ruled by its one or two hard pairs once most are learnt: a longer median
        window = t.smooth_window
        if kind == "pair_mean":
            window = max(window, round(t.pair_smooth_share * len(loss)))
        shape = loss_shape(run.step, loss, window, int(run.config_value("optim.warmup_steps", 0) or 0))
    return JudgedLoss(shape, rise=max(t.divergence_rise, t.divergence_wobbles * shape.wobble),
                      excursion=max(t.excursion, t.excursion_wobbles * shape.wobble),
                      wobble=t.oscillation if kind == "token_mean" else np.inf)


def _median_after_warmup(run: RunData, values: np.ndarray) -> float:
    warmup = int(run.config_value("optim.warmup_steps", 0) or 0)
    mask = (run.step > warmup) & np.isfinite(values)
    return float(np.median(values[mask] if mask.sum() >= 3 else values[np.isfinite(values)]))


def loss_divergence(run: RunData, t: Thresholds) -> Finding | None:
    """The loss is non-finite at the end, or ended well above its lowest (smoothed) point. Non-finite steps the
    run recovered from (skipped or rolled back) are anomaly incidents, not divergence."""
    judged = _judged_loss(run, t)
    shape = judged.shape
    ends_nonfinite = any(s >= run.step[-t.smooth_window] for s in shape.nonfinite_steps)
    if not ends_nonfinite and shape.rise <= judged.rise:
        return None
    low_step = int(run.step[shape.min_index])
    summary = (f"the smoothed loss fell to {shape.smoothed[shape.min_index]:.3f} at step {low_step}, then rose "
               f"{100 * shape.rise:.0f}% to {shape.smoothed[-1]:.3f} by step {int(run.step[-1])}")
    if len(shape.nonfinite_steps) == len(run.step):
        summary = f"the loss is non-finite on every step ({len(run.step)}), from the first"
    elif shape.nonfinite_steps:
        summary = f"non-finite loss on {len(shape.nonfinite_steps)} steps (first {shape.nonfinite_steps[0]}); " + summary
    return Finding("loss_divergence", CRITICAL,
                   {"summary": summary, "steps": shape.nonfinite_steps[:20] or [low_step, int(run.step[-1])],
                    "values": {"rise": shape.rise, "threshold": judged.rise}},
                   "Lower optim.lr (try 3-10x lower) or lengthen optim.warmup_steps; resume from the checkpoint "
                   "before the loss turned up.")


def loss_oscillation(run: RunData, t: Thresholds) -> Finding | None:
    """The smoothed loss climbed back up well above its low at some point, or after warmup it jumps by a
    large fraction from step to step."""
    judged = _judged_loss(run, t)
    shape, limit = judged.shape, judged.excursion
    if not np.isfinite(shape.excursion):  # no finite loss at all: loss_divergence says so
        return None
    if shape.excursion <= limit and shape.wobble <= judged.wobble:
        return None
    start, peak = int(run.step[shape.excursion_from]), int(run.step[shape.excursion_to])
    parts = []
    if shape.excursion > limit:
        parts.append(f"the smoothed loss climbed {100 * shape.excursion:.1f}% from "
                     f"{shape.smoothed[shape.excursion_from]:.3f} at step {start} to "
                     f"{shape.smoothed[shape.excursion_to]:.3f} at step {peak} (more than {100 * limit:.1f}%: "
                     f"{t.excursion_wobbles:g}x its step-to-step wobble of {100 * shape.wobble:.1f}%, or "
                     f"{100 * t.excursion:.0f}%)")
    if shape.wobble > judged.wobble:
        parts.append(f"after warmup the loss changes by a median {100 * shape.wobble:.1f}% from one step to the "
                     "next (healthy runs: 1-2%)")
    return Finding("loss_oscillation", WARNING,
                   {"summary": "; ".join(parts),
                    "steps": [start, peak],
                    "values": {"excursion": shape.excursion, "wobble": shape.wobble,
                               "thresholds": {"excursion": limit, "oscillation": judged.wobble}}},
                   "Lower optim.lr or lengthen optim.warmup_steps; raise train.batch_size if the wobble is batch "
                   "noise.")


def lr_too_high(run: RunData, t: Thresholds) -> Finding | None:
    """An unstable loss caused by the step size: large update/param ratios, or (without them) the loss climbing
    while the LR rose, the signature of an LR range test past its good range."""
    judged = _judged_loss(run, t)
    shape = judged.shape
    # The update ratio is a second witness here, so a climb past the fixed limits is enough: healthy runs climb
    # as far (3-7%, within their noise) but with updates 2-3x below large_update_ratio
    if not judged.unstable(t.divergence_rise, t.excursion):
        return None
    ratio = run.series("update_ratio")
    if ratio is not None:
        # the ratio while the loss was going wrong: the climb, else from the lowest point on
        window = (slice(shape.excursion_from, shape.excursion_to + 1) if shape.excursion > t.excursion
                  else slice(shape.min_index, None))
        values = ratio[window][np.isfinite(ratio[window])]
        median = float(np.median(values)) if values.size else float("nan")
        if not median > t.large_update_ratio:
            return None
        evidence = {"summary": f"the loss is unstable (climbed {100 * shape.excursion:.0f}% above its low, ends "
                               f"{100 * shape.rise:.0f}% above it) with a median update/param ratio of {median:.2g} "
                               f"per step over steps {int(run.step[window][0])}..{int(run.step[window][-1])}",
                    "steps": [int(run.step[window][0]), int(run.step[window][-1])],
                    "values": {"update_ratio_median": median, "threshold": t.large_update_ratio}}
    else:
        evidence = _lr_range_signature(run, shape)
    return Finding("lr_too_high", CRITICAL, evidence,
                   f"Lower optim.lr (now {run.config_value('optim.lr')}) by 3-10x; keep warmup at least as long.")


def _lr_range_signature(run: RunData, shape: LossShape) -> dict:
    """Evidence that the loss climbed because the LR grew: the LR at the climb's top is well above the LR at the
    low it climbed from."""
    lr = required_series(run, "lr")
    low, top = shape.excursion_from, shape.excursion_to
    if not (top > low and lr[top] > 1.5 * lr[low]):
        raise NotEvaluated("the loss is unstable but metrics.jsonl has no `update_ratio`, and the loss did not climb "
                           "as the LR rose, so the LR cannot be singled out")
    return {"summary": f"the loss fell while the LR rose to {lr[low]:.2g} (smoothed {shape.smoothed[low]:.3f} at step "
                       f"{int(run.step[low])}), then climbed {100 * shape.excursion:.0f}% to "
                       f"{shape.smoothed[top]:.3f} by step {int(run.step[top])} as the LR rose to {lr[top]:.2g}: the "
                       "LR went past its stable range (no update_ratio in this run to confirm)",
            "steps": [int(run.step[low]), int(run.step[top])],
            "values": {"lr_at_low": float(lr[low]), "lr_at_top": float(lr[top]), "excursion": shape.excursion}}


def warmup_too_short(run: RunData, t: Thresholds) -> Finding | None:
    """The loss blew up early (during or just after warmup) and then recovered."""
    judged = _judged_loss(run, t)
    shape = judged.shape
    warmup = int(run.config_value("optim.warmup_steps", 0) or 0)
    early = run.step <= max(2 * warmup, t.min_steps)
    if early.all() or early.sum() < t.smooth_window:
        raise NotEvaluated("the run is not longer than twice its warmup, so recovery after it cannot be seen")
    smooth = shape.smoothed
    running_low = np.fmin.accumulate(np.where(np.isfinite(smooth), smooth, np.inf))
    early_rise = np.nanmax((smooth[early] - running_low[early]) / running_low[early])
    recovered = shape.rise <= judged.rise and smooth[-1] < np.nanmax(smooth[early])
    if early_rise <= judged.rise or not recovered:
        return None
    peak = int(run.step[early][np.nanargmax(smooth[early] - running_low[early])])
    return Finding("warmup_too_short", WARNING,
                   {"summary": f"the smoothed loss rose {100 * early_rise:.0f}% above its low by step {peak}, within "
                               f"the first {int(run.step[early][-1])} steps (warmup {warmup}), then recovered",
                    "steps": [peak], "values": {"early_rise": float(early_rise), "warmup_steps": warmup}},
                   f"Lengthen optim.warmup_steps (now {warmup}) 2-4x, or lower the peak optim.lr.")


def gradient_explosion(run: RunData, t: Thresholds) -> Finding | None:
    """Non-finite gradient norms, spikes on many steps, or a gradient norm whose level keeps growing."""
    grad = required_series(run, "grad_norm")
    nonfinite = [int(s) for s in run.step[~np.isfinite(grad)]]
    spikes = trailing_ratio(grad, 10) > t.grad_spike_ratio
    level = running_median(grad, max(9, round(t.grad_level_share * len(grad))))
    growth = float(np.nanmax(level / np.fmin.accumulate(np.where(level > 0, level, np.inf))))
    share = float(spikes.sum() / len(grad))
    if not nonfinite and share <= t.grad_spike_share and growth <= t.grad_growth:
        return None
    return Finding("gradient_explosion", CRITICAL,
                   {"summary": f"gradient norm: {len(nonfinite)} non-finite steps, spikes (>{t.grad_spike_ratio:g}x "
                               f"the recent median) on {100 * share:.0f}% of steps, level grew "
                               + (f"{growth:.1f}x" if np.isfinite(growth) else "(no finite level)"),
                    "steps": (nonfinite + [int(s) for s in run.step[spikes]])[:20],
                    "values": {"spike_share": share, "growth": growth, "max_grad_norm": float(np.nanmax(grad))}},
                   "Check optim.clip_norm is set (1.0 is usual); lower optim.lr; look for bad batches at the "
                   "spike steps; consider QK-norm or z-loss if attention or output logits grow.")


def clipping_dominant(run: RunData, t: Thresholds) -> Finding | None:
    """Global-norm clipping rescales the gradient on most steps after warmup."""
    clip = float(run.config_value("optim.clip_norm", 0.0) or 0.0)
    if clip <= 0:
        raise NotEvaluated("gradient clipping is off (optim.clip_norm <= 0 or absent from config.json)")
    grad = required_series(run, "grad_norm")
    warmup = int(run.config_value("optim.warmup_steps", 0) or 0)
    after = run.step > warmup if np.sum(run.step > warmup) >= t.min_steps else np.ones(len(grad), bool)
    share = float(np.mean(grad[after] > clip))
    if share <= t.clip_share:
        return None
    return Finding("clipping_dominant", WARNING,
                   {"summary": f"the gradient norm exceeds optim.clip_norm={clip:g} on {100 * share:.0f}% of steps "
                               f"after warmup (median {np.nanmedian(grad[after]):.3g})",
                    "values": {"clipped_share": share, "clip_norm": clip, "threshold": t.clip_share}},
                   "Clipping is acting as a second LR schedule: lower optim.lr, or raise optim.clip_norm to about "
                   "the median gradient norm if the loss is stable.")


def slow_convergence(run: RunData, t: Thresholds) -> Finding | None:
    """A run from scratch whose loss barely moved."""
    judged = _judged_loss(run, t)
    shape = judged.shape
    if run.step[0] > t.smooth_window:
        raise NotEvaluated(f"the records start at step {int(run.step[0])} (a resumed or cut run): no start to "
                           "measure progress from")
    if shape.progress >= t.min_progress or judged.unstable():
        return None
    return Finding("slow_convergence", WARNING,
                   {"summary": f"over {len(run.step)} steps the smoothed loss fell only {100 * shape.progress:.1f}% "
                               f"(to {shape.smoothed[-1]:.3f})",
                    "values": {"progress": shape.progress, "threshold": t.min_progress}},
                   "Check the findings on the LR and per-layer gradients; raise optim.lr if updates are tiny.")


def lr_too_low(run: RunData, t: Thresholds) -> Finding | None:
    """Updates tiny next to the parameters, and the loss barely moving."""
    ratio = _median_after_warmup(run, required_series(run, "update_ratio"))
    if not np.isfinite(ratio):
        raise NotEvaluated("`update_ratio` has no finite values")
    shape = _judged_loss(run, t).shape
    if ratio >= t.tiny_update_ratio or shape.progress >= t.min_progress:
        return None
    return Finding("lr_too_low", WARNING,
                   {"summary": f"median update/param ratio {ratio:.2g} per step (AdamW healthy ~1e-3) and the loss "
                               f"fell only {100 * shape.progress:.1f}%",
                    "values": {"update_ratio_median": ratio, "threshold": t.tiny_update_ratio}},
                   f"Raise optim.lr (now {run.config_value('optim.lr')}) 10-100x.")


def output_logits_saturated(run: RunData, t: Thresholds) -> Finding | None:
    """The output softmax starts (or ends up) one-hot: a model initialised well starts near the loss of a
    uniform guess, ln(vocab_size); far above it the logits are so large that confident mistakes dominate (an
    init_std far too large). Also large output logits when `diag/logits_max` is logged."""
    vocab = int(run.config_value("model.vocab_size", 0) or 0)
    logits = run.diag.get("diag/logits_max")
    if vocab <= 1 and logits is None:
        raise NotEvaluated("neither model.vocab_size in config.json nor `diag/logits_max` records")
    values = {}
    if vocab > 1 and run.step[0] <= 1:
        first = float(required_series(run, "loss")[0])
        if first > t.initial_loss_ratio * np.log(vocab):
            values["first_loss"], values["uniform_loss"] = first, float(np.log(vocab))
    if logits is not None and np.isfinite(logits[1]).any() and np.nanmax(logits[1]) > t.logits_max:
        values["logits_max"] = float(np.nanmax(logits[1]))
    if not values:
        return None
    parts = []
    if "first_loss" in values:
        parts.append(f"the first loss is {values['first_loss']:.3g}, {values['first_loss'] / values['uniform_loss']:.1f}x "
                     f"a uniform guess's ln({vocab}) = {values['uniform_loss']:.3g}")
    if "logits_max" in values:
        parts.append(f"output logits reach {values['logits_max']:.3g} (limit {t.logits_max:g})")
    return Finding("output_logits_saturated", WARNING, {"summary": "; ".join(parts), "values": values},
                   f"Lower model.init_std (now {run.config_value('model.init_std')}; 0.02 is usual) or scale the "
                   "output layer's initialisation down; z-loss or logit soft-capping bound the logits.")


def anomaly_incidents(run: RunData, t: Thresholds) -> Finding | None:
    """The run's anomaly incidents (incidents.jsonl) and what recovery did about them."""
    if not (run.root / "incidents.jsonl").exists():
        raise NotEvaluated("no incidents.jsonl (a run of a version before anomaly recovery)")
    if not run.incidents:
        return None
    kinds = Counter(i.get("kind", "?") for i in run.incidents)
    actions = Counter(str(i.get("action", "?")) for i in run.incidents)
    acted = [i for i in run.incidents if i.get("action") != "reported"]
    restored = sorted({i["restored_step"] for i in acted if "restored_step" in i})
    summary = (f"{len(run.incidents)} incidents ({', '.join(f'{n} {k}' for k, n in kinds.items())}); recovery: "
               f"{', '.join(f'{n} {a}' for a, n in actions.items())}"
               + (f", rolled back to steps {restored}" if restored else ""))
    return Finding("anomaly_incidents", WARNING if acted else INFO,
                   {"summary": summary, "steps": [int(i["step"]) for i in run.incidents][:20],
                    "values": {"kinds": dict(kinds), "actions": dict(actions)}},
                   "Look at the data at the listed steps; repeated incidents usually mean the LR is too high "
                   "(see the LR findings)." if acted else "None needed if they stay rare: reported only.")


RULES: tuple[Rule, ...] = (loss_divergence, loss_oscillation, lr_too_high, warmup_too_short, gradient_explosion,
                           clipping_dominant, slow_convergence, lr_too_low, output_logits_saturated,
                           anomaly_incidents)
