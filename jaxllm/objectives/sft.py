"""Supervised fine-tuning as an objective: the base LM (with LoRA adapters, or all of it trainable at lora.rank=0),
the masked next-token loss of pretraining on packed prompt/response rows, and task metrics (exact match, BLEU) of
greedy responses to held-out prompts before and after training.

The data is prepared into `data.path` at the start of the run (jaxllm/data/sft.py; skipped when up to date) with
the base model's tokenizer, so a resumed or repeated run reads the same rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxllm.config.schema import Config
from jaxllm.data.sft import eval_prompts, prepare_sft
from jaxllm.data.sft_template import stop_ids
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.eval.task_eval import evaluate_task
from jaxllm.objectives.finetune import check_vocab, data_errors, locate_base, row_batches, tokenizer_path
from jaxllm.train.objective import Objective
from jaxllm.objectives.pretrain import lm_objective


def sft_objective(cfg: Config, log=print) -> Objective:
    """The SFT objective of a resolved `cfg`, preparing the data first."""
    base = locate_base(cfg, "sft")
    tokenizer_file = tokenizer_path(cfg, base, "sft")
    sc, tc = cfg.sft, cfg.train
    with data_errors("sft"):
        manifest = prepare_sft(cfg.data.path, train_file=sc.train_file, eval_file=sc.eval_file,
                               tokenizer_path=tokenizer_file, template=sc.template, seq_len=tc.seq_len,
                               overlong=sc.overlong, eval_fraction=sc.eval_fraction, seed=tc.seed, log=log)
    check_vocab(cfg, manifest, tokenizer_file)
    directory = Path(cfg.data.path)
    tokenizer = load_tokenizer(directory / manifest["tokenizer"])
    examples = eval_prompts(directory)[: sc.eval_examples]
    open_batches, eval_batches = row_batches(cfg, directory)
    stops = stop_ids(sc.template, tokenizer)

    def report(graphdef, variables, mesh):
        return evaluate_task(graphdef, variables, mesh, tokenizer, examples, max_new_tokens=sc.max_new_tokens,
                             max_len=tc.seq_len, stop_ids=stops)

    lora = cfg.lora if cfg.lora.rank else None
    lm = lm_objective(cfg.model, cfg.precision, cfg.pipeline, lora, rope_scaling=base and base.rope_scaling,
                      sequence_parallel=cfg.mesh.sequence_parallel)
    return dataclasses.replace(lm, name="sft", open_batches=open_batches, eval_batches=eval_batches,
                                    tokenizer=tokenizer, sample_prompt=None, base=base,
                                    report=report if examples else None)
