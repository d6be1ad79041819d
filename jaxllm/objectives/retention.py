"""What post-training costs the task a model was fine-tuned for: a DPO, GRPO or PPO run whose base is an SFT run
also reports that run's task (exact match and BLEU on its held-out prompts, and the perplexity of its held-out
responses) before and after training, next to its own report. DPO alone was seen taking the shipped SFT task
from 32.9% to 0.25% exact match without a word (`dpo.rpo_alpha` is the usual guard).

The SFT run's prepared data (its `data.path`, where its held-out prompts and rows are) is read as it was left;
when it is gone the report says so once and the run goes on without it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import jax.numpy as jnp

from jaxllm.data.row_prep import PreparedDataError, PreparedRows, existing_manifest
from jaxllm.data.sft import FORMAT, eval_prompts
from jaxllm.data.sft_template import stop_ids
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.eval.task_eval import ALL, evaluate_task
from jaxllm.model.head import head_stats
from jaxllm.objectives.pair_eval import score_rows
from jaxllm.train.objective import SFT_TASK


def response_nll(model, batch) -> dict:
    """Per row [B, 1]: the summed negative log-likelihood of its response tokens (loss_mask) and their count."""
    x_BTD = model.hidden_states(batch["tokens"], batch["segment_ids"], batch["positions"])
    logps_BT, _ = head_stats(model, x_BTD, batch["targets"])
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    return {"nll": -jnp.sum(logps_BT * mask_BT, axis=1, keepdims=True), "tokens": jnp.sum(mask_BT, axis=1,
                                                                                          keepdims=True)}


def sft_task_report(base, batch_size: int, log=print) -> Callable | None:
    """`report(graphdef, variables, mesh) -> {group: scores}` of the SFT task of the run `base` (a located base)
    was trained by: task scores per group, and "perplexity" of the held-out responses under "all". None when the
    base is not an SFT run, or its prepared data is gone (said in the log)."""
    recorded = base.config or {}
    if (recorded.get("train") or {}).get("objective") != "sft":
        return None
    directory = Path((recorded.get("data") or {}).get("path", ""))
    try:
        manifest = existing_manifest(directory, FORMAT)
    except PreparedDataError:
        manifest = None
    if manifest is None:
        log(f"no SFT task report: the base's SFT data is no longer at {directory}")
        return None
    tokenizer = load_tokenizer(directory / manifest["tokenizer"])
    sft, seq_len = recorded.get("sft") or {}, manifest["seq_len"]
    examples = eval_prompts(directory)[: sft.get("eval_examples", 64)]
    rows = {f: a[:] for f, a in PreparedRows(directory, "eval", shuffle=False).arrays.items()}
    stops = stop_ids(sft.get("template", "alpaca"), tokenizer)

    def report(graphdef, variables, mesh) -> dict:
        scores = evaluate_task(graphdef, variables, mesh, tokenizer, examples, stop_ids=stops,
                               max_new_tokens=sft.get("max_new_tokens", 32), max_len=seq_len)["scores"]
        summed = score_rows(graphdef, variables, mesh, rows, batch_size, response_nll)
        scores.setdefault(ALL, {"examples": 0})["perplexity"] = math.exp(summed["nll"].sum() / summed["tokens"].sum())
        return scores

    return report


def with_sft_task(report: Callable | None, base, batch_size: int, log=print) -> Callable | None:
    """`report` with the SFT task of `base` (see `sft_task_report`) added under SFT_TASK, when there is one."""
    task = sft_task_report(base, batch_size, log)
    if task is None:
        return report

    def both(graphdef, variables, mesh) -> dict:
        out = dict(report(graphdef, variables, mesh)) if report else {"scores": {}, "samples": []}
        out[SFT_TASK] = task(graphdef, variables, mesh)
        return out

    return both
