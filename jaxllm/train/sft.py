"""Supervised fine-tuning as an objective: the base LM (with LoRA adapters, or all of it trainable at lora.rank=0),
the masked next-token loss of pretraining on packed prompt/response rows, and task metrics (exact match, BLEU) of
greedy responses to held-out prompts before and after training.

The data is prepared into `data.path` at the start of the run (jaxllm/data/sft.py; skipped when up to date) with
the base model's tokenizer, so a resumed or repeated run reads the same rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxllm.config import Config, ConfigError
from jaxllm.data.pipeline import EvalBatches, TrainIterator
from jaxllm.data.sft import SFTDataError, SFTRows, eval_prompts, prepare_sft
from jaxllm.data.sft_template import TemplateError
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.task_eval import evaluate_task
from jaxllm.train import base_model
from jaxllm.train.objective import BatchRequest, Objective
from jaxllm.train.pretrain import lm_objective


def _tokenizer_path(cfg: Config, base: base_model.Base | None) -> Path:
    if cfg.sft.tokenizer:
        return Path(cfg.sft.tokenizer)
    if base is not None and base.tokenizer is not None:
        return base.tokenizer
    raise ConfigError("sft.tokenizer", "no tokenizer found with the base model (checkpoint.restore_from); name the "
                                       "base model's tokenizer.model or tokenizer.json")


def sft_objective(cfg: Config, num_devices: int, log=print) -> tuple[Config, Objective]:
    """(cfg with the base's architecture, the SFT objective), preparing the data first."""
    if cfg.checkpoint.restore_all:
        raise ConfigError("checkpoint.restore_all", "not for train.objective=sft (it starts from the base's "
                                                    "parameters only)")
    for key in ("train_file", "eval_file", "tokenizer"):
        path = getattr(cfg.sft, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"sft.{key}", f"no such file: {path}")
    base = base_model.locate(cfg.checkpoint.restore_from) if cfg.checkpoint.restore_from else None
    if base is not None:
        cfg = base_model.adopt_architecture(cfg, base, num_devices)
    tokenizer_path = _tokenizer_path(cfg, base)
    sc, tc = cfg.sft, cfg.train
    try:
        manifest = prepare_sft(cfg.data.path, train_file=sc.train_file, eval_file=sc.eval_file,
                               tokenizer_path=tokenizer_path, template=sc.template, seq_len=tc.seq_len,
                               overlong=sc.overlong, eval_fraction=sc.eval_fraction, seed=tc.seed, log=log)
    except TemplateError as exc:
        raise ConfigError("sft.template", str(exc)) from None
    except SFTDataError as exc:
        raise ConfigError(exc.key, str(exc)) from None
    except (FileNotFoundError, ValueError) as exc:  # the tokenizer file
        raise ConfigError("sft.tokenizer", str(exc)) from None
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the tokenizer's "
                                              f"{manifest['vocab_size']} tokens ({tokenizer_path})")
    tokenizer = load_tokenizer(Path(cfg.data.path) / manifest["tokenizer"])
    directory = Path(cfg.data.path)
    examples = eval_prompts(directory)[: sc.eval_examples]

    def open_batches(request: BatchRequest):
        index, count = request.rows
        return TrainIterator(SFTRows(directory, "train", tc.seed), global_batch_size=tc.batch_size,
                             process_index=index, process_count=count, start_step=request.first,
                             num_steps=request.end, num_workers=cfg.data.num_workers, prefetch=2)

    def eval_batches(rows):
        index, count = rows
        return list(EvalBatches(SFTRows(directory, "eval", shuffle=False), tc.batch_size, tc.eval_batches or None,
                                index, count))

    def report(graphdef, variables, mesh):
        return evaluate_task(graphdef, variables, mesh, tokenizer, examples, max_new_tokens=sc.max_new_tokens,
                             max_len=tc.seq_len)

    lora = cfg.lora if cfg.lora.rank else None
    lm = lm_objective(cfg.model, cfg.precision, cfg.pipeline, lora, rope_scaling=base and base.rope_scaling)
    return cfg, dataclasses.replace(lm, name="sft", open_batches=open_batches, eval_batches=eval_batches,
                                    tokenizer=tokenizer, sample_prompt=None, base=base,
                                    report=report if examples else None)
