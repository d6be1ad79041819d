"""Diagnosis rules on the per-layer diagnostic records (`diag/<stat>/layer_<i>`, logged every N steps): a layer
whose norms stand far from the others (dead or exploding), gradients vanishing toward the input, saturated
SwiGLU gates, and growing attention logits. Each names the layers it rests on.
"""

from __future__ import annotations

import numpy as np

from jaxllm.diagnose.findings import CRITICAL, WARNING, Finding, NotEvaluated, Rule, Thresholds
from jaxllm.diagnose.run_data import DIAG_PREFIX, RunData

# The per-layer norms compared across layers, most telling first: a layer that does not learn shows first in its
# update ratio, a zeroed one in every norm.
OUTLIER_STATS = ("update_ratio", "grad_norm", "update_norm", "param_norm")


def _layer_medians(run: RunData, stat: str, last_fraction: float = 1.0, prefix: str = DIAG_PREFIX,
                   absent: str = "per-layer diagnostics off, or an older run") -> dict[int, float]:
    """{layer: median of the finite values of <prefix><stat>/layer_<i>, the last `last_fraction` of them};
    NotEvaluated, saying why they may be `absent`, when the run logged no such records. (Step records hold NaN
    where a step lacks the field, so a tail of finite values, not of records.)"""
    series = run.layer_series(stat, prefix)
    if not series:
        raise NotEvaluated(f"metrics.jsonl has no `{prefix}{stat}/layer_<i>` records ({absent})")
    medians = {}
    for layer, (_, values) in sorted(series.items()):
        finite = values[np.isfinite(values)]
        tail = finite[-max(1, int(np.ceil(len(finite) * last_fraction))):]
        medians[layer] = float(np.median(tail)) if tail.size else float("nan")
    return medians


def _outliers(run: RunData, t: Thresholds, dead: bool) -> dict[int, dict]:
    """{layer: {stat: (value, median of the other layers)}} of layers below 1/x (`dead`) or above x times the
    median of the others, x = t.layer_outlier (t.layer_grad_outlier for gradient norms), over OUTLIER_STATS."""
    found: dict[int, dict] = {}
    available = 0
    for stat in OUTLIER_STATS:
        try:
            medians = _layer_medians(run, stat)
        except NotEvaluated:
            continue
        available += 1
        if len(medians) < 2:
            raise NotEvaluated(f"only {len(medians)} layer in the diag records: nothing to compare it with")
        for layer, value in medians.items():
            others = float(np.nanmedian([v for k, v in medians.items() if k != layer]))
            if not others > 0:
                continue
            limit = t.layer_grad_outlier if stat == "grad_norm" else t.layer_outlier
            off = value < others / limit if dead else value > others * limit
            if off:
                found.setdefault(layer, {})[stat] = {"value": value, "others_median": others}
    if not available:
        raise NotEvaluated("metrics.jsonl has no per-layer norm records (`diag/update_ratio/layer_<i>`, "
                           "`diag/grad_norm/layer_<i>`, ...)")
    return found


def _describe(layers: dict[int, dict]) -> str:
    return "; ".join(f"layer {layer}: " + ", ".join(f"{stat} {v['value']:.3g} vs {v['others_median']:.3g} for the "
                                                   f"others" for stat, v in stats.items())
                     for layer, stats in sorted(layers.items()))


def dead_layer(run: RunData, t: Thresholds) -> Finding | None:
    """A layer whose norms are far below the other layers' (it does not learn)."""
    layers = _outliers(run, t, dead=True)
    if not layers:
        return None
    return Finding("dead_layer", CRITICAL,
                   {"summary": f"{_describe(layers)} (below 1/{t.layer_outlier:g} of the others; gradient norms "
                               f"1/{t.layer_grad_outlier:g})",
                    "layers": sorted(layers), "values": {f"layer_{k}": v for k, v in layers.items()}},
                   "Check how these layers are initialised or frozen (all-zero weights receive zero gradients "
                   "and never train); re-initialise them or remove what freezes them.")


def exploding_layer(run: RunData, t: Thresholds) -> Finding | None:
    """A layer whose norms are far above the other layers'."""
    layers = _outliers(run, t, dead=False)
    if not layers:
        return None
    return Finding("exploding_layer", CRITICAL,
                   {"summary": f"{_describe(layers)} (above {t.layer_outlier:g}x the others; gradient norms "
                               f"{t.layer_grad_outlier:g}x)",
                    "layers": sorted(layers), "values": {f"layer_{k}": v for k, v in layers.items()}},
                   "Lower optim.lr or tighten optim.clip_norm; check that layer's initialisation (model.init_std) "
                   "and its inputs' scale (activation RMS plot).")


def vanishing_gradients(run: RunData, t: Thresholds) -> Finding | None:
    """Gradient norms that fall toward the input: layers below a small fraction of the largest layer's, with
    the first layer among them (zeros are dead layers, not vanishing ones)."""
    medians = _layer_medians(run, "grad_norm")
    top = max(medians.values())
    low = {k: v for k, v in medians.items() if 0 < v < t.vanishing_ratio * top}
    if not low or min(medians) not in low:
        return None
    return Finding("vanishing_gradients", WARNING,
                   {"summary": "gradient norms of layers " + ", ".join(f"{k} ({v:.2g})" for k, v in low.items())
                               + f" are below {t.vanishing_ratio:g} of the largest layer's ({top:.2g})",
                    "layers": sorted(low), "values": {"grad_norm": medians}},
                   "The residual stream is not carrying gradients down: check the norms (pre-norm layers), "
                   "model.init_std, and that no activation saturates.")


def saturated_gates(run: RunData, t: Thresholds) -> Finding | None:
    """SwiGLU gates whose inputs sit in silu's flat tails (recent records)."""
    medians = _layer_medians(run, "gate_saturation", last_fraction=1 / 3)
    high = {k: v for k, v in medians.items() if v > t.gate_saturation}
    if not high:
        return None
    return Finding("saturated_gates", WARNING,
                   {"summary": "gate saturation " + ", ".join(f"layer {k}: {100 * v:.0f}%" for k, v in high.items())
                               + f" (above {100 * t.gate_saturation:.0f}%)",
                    "layers": sorted(high), "values": {"gate_saturation": medians}},
                   "Lower model.init_std (0.02 is usual) or optim.lr; saturated gates pass little gradient.")


def attention_logit_growth(run: RunData, t: Thresholds) -> Finding | None:
    """Attention logits past the hard limit, or still growing at the end of the run: above the floor and several
    times their level over the middle third of the records. Growth from the first record alone is what every
    run from scratch shows (attention sharpens as it learns, then levels off), and a fine-tuning run starts
    where its base left them."""
    series = run.layer_series("attn_logit_max")
    if not series:
        raise NotEvaluated("metrics.jsonl has no `diag/attn_logit_max/layer_<i>` records")
    flagged = {}
    for layer, (steps, values) in sorted(series.items()):
        finite = values[np.isfinite(values)]
        if not finite.size:
            continue
        last, first = float(finite[-1]), float(finite[0])
        third = len(finite) // 3
        middle = float(np.median(finite[third:2 * third])) if third else first
        growing = middle > 0 and last / middle > t.attn_logit_growth and last > t.attn_logit_floor
        if last > t.attn_logit_max or growing:
            flagged[layer] = {"first": first, "middle": middle, "last": last, "last_step": int(steps[-1])}
    if not flagged:
        return None
    return Finding("attention_logit_growth", WARNING,
                   {"summary": "max attention logit " + ", ".join(
                       f"layer {k}: {v['first']:.3g} -> {v['middle']:.3g} -> {v['last']:.3g}" for k, v in flagged.items())
                               + f" (first, middle third, last; limit {t.attn_logit_max:g}, or above "
                                 f"{t.attn_logit_floor:g} and {t.attn_logit_growth:g}x the middle third's)",
                    "layers": sorted(flagged), "values": flagged},
                   "Softmax is turning one-hot: lower optim.lr or model.init_std; QK-norm or logit soft-capping "
                   "bound the growth.")


def expert_collapse(run: RunData, t: Thresholds) -> Finding | None:
    """A mixture of experts whose routers send most tokens to a few experts (recent steps): in a layer, the busiest
    k experts (k = experts per token) take a share of the picks far above the k/E of an even router. Nothing to
    judge for a dense model."""
    experts, k = run.config_value("model.num_experts", 0), run.config_value("model.experts_per_token", 1)
    if not experts:
        return None
    shares = _layer_medians(run, "expert_top_share", 1 / 3, prefix="moe/", absent="an older run")
    even = k / experts
    limit = even + t.expert_concentration * (1 - even)
    high = {layer: share for layer, share in shares.items() if share > limit}
    if not high:
        return None
    return Finding("expert_collapse", WARNING,
                   {"summary": f"the busiest {k} of {experts} experts take " + ", ".join(
                       f"layer {layer}: {100 * share:.0f}%" for layer, share in high.items())
                               + f" of the picks (last third of the steps; even: {100 * even:.0f}%, limit "
                                 f"{100 * limit:.0f}%)",
                    "layers": sorted(high), "values": {"expert_top_share": shares}},
                   "Raise model.moe_aux_loss_coef (0.01 is usual; 0 turns load balancing off) or lower "
                   "optim.lr; check the router's initialisation. Collapsed experts waste the others' weights.")


LAYER_RULES: tuple[Rule, ...] = (dead_layer, exploding_layer, vanishing_gradients, saturated_gates,
                                 attention_logit_growth, expert_collapse)
