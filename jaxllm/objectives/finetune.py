"""What every fine-tuning objective (SFT, reward model, DPO) does the same way: locate the base model and adopt
its architecture, find the tokenizer its data is encoded with, turn data errors into one-line config errors, and
read batches from prepared rows.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from jaxllm.config.schema import Config, ConfigError, resolve_vocab_size
from jaxllm.data.pipeline import EvalBatches, TrainIterator
from jaxllm.data.row_prep import PreparedDataError, PreparedRows
from jaxllm.data.sft_template import TemplateError
from jaxllm.runs import base_model
from jaxllm.train.objective import BatchRequest


def locate_base(cfg: Config, section: str) -> tuple[Config, base_model.Base | None]:
    """(cfg with the base's architecture, the base named by checkpoint.restore_from or None), after checking the
    data files named in `cfg.<section>` exist."""
    if cfg.checkpoint.restore_all:
        raise ConfigError("checkpoint.restore_all", f"not for train.objective={cfg.train.objective} (it starts from "
                                                    "the base's parameters only)")
    for key in ("train_file", "eval_file", "tokenizer"):
        path = getattr(getattr(cfg, section), key)
        if path and not Path(path).is_file():
            raise ConfigError(f"{section}.{key}", f"no such file: {path}")
    base = base_model.locate(cfg.checkpoint.restore_from) if cfg.checkpoint.restore_from else None
    if base is not None:
        cfg = base_model.adopt_architecture(cfg, base)
    return cfg, base


def tokenizer_path(cfg: Config, base: base_model.Base | None, section: str) -> Path:
    """`cfg.<section>.tokenizer`, else the base model's tokenizer."""
    named = getattr(cfg, section).tokenizer
    if named:
        return Path(named)
    if base is not None and base.tokenizer is not None:
        return base.tokenizer
    raise ConfigError(f"{section}.tokenizer", "no tokenizer found with the base model (checkpoint.restore_from); "
                                              "name the base model's tokenizer.model or tokenizer.json")


@contextlib.contextmanager
def data_errors(section: str):
    """Preparation errors as ConfigErrors naming the key."""
    try:
        yield
    except TemplateError as exc:
        raise ConfigError(f"{section}.template", str(exc)) from None
    except PreparedDataError as exc:
        raise ConfigError(exc.key, str(exc)) from None
    except (FileNotFoundError, ValueError) as exc:  # the tokenizer file
        raise ConfigError(f"{section}.tokenizer", str(exc)) from None


def check_vocab(cfg: Config, manifest: dict, tokenizer: Path) -> Config:
    """`cfg` with its vocabulary checked against (or, "auto", sized from) the prepared data's tokenizer."""
    return resolve_vocab_size(cfg, manifest["vocab_size"], str(tokenizer))


def row_batches(cfg: Config, directory: Path, extra: dict | None = None):
    """(open_batches, eval_batches) of an objective whose data is prepared rows in `directory`; `extra` gives
    per split further per-row arrays ({split: {field: path}}) that travel with the rows."""
    tc, extra = cfg.train, extra or {}

    def open_batches(request: BatchRequest):
        index, count = request.rows
        return TrainIterator(PreparedRows(directory, "train", tc.seed, extra=extra.get("train")),
                             global_batch_size=tc.batch_size, process_index=index, process_count=count,
                             start_step=request.first, num_steps=request.end, num_workers=cfg.data.num_workers,
                             prefetch=2)

    def eval_batches(rows):
        index, count = rows
        return list(EvalBatches(PreparedRows(directory, "eval", shuffle=False, extra=extra.get("eval")),
                                tc.batch_size, tc.eval_batches or None, index, count))

    return open_batches, eval_batches
