"""What every fine-tuning objective (SFT, reward model, DPO) does the same way: locate the base model and adopt
its architecture, find the tokenizer its data is encoded with, turn data errors into one-line config errors, and
read batches from prepared rows.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from jaxllm.config.schema import AUTO_VOCAB, Config, ConfigError, resolve_vocab_size
from jaxllm.data.pipeline import EvalBatches, TrainIterator
from jaxllm.data.row_prep import PreparedDataError, PreparedRows
from jaxllm.data.sft_template import TemplateError
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.runs import base_model
from jaxllm.train.objective import BatchRequest


def locate_base(cfg: Config, section: str) -> base_model.Base | None:
    """The base named by checkpoint.restore_from (None without one), after checking the data files named in
    `cfg.<section>` exist. Its architecture is already the config's (`jaxllm.objectives.registry.resolved_shape`)."""
    if cfg.checkpoint.restore_all:
        raise ConfigError("checkpoint.restore_all", f"not for train.objective={cfg.train.objective} (it starts from "
                                                    "the base's parameters only)")
    for key in ("train_file", "eval_file", "tokenizer"):
        path = getattr(getattr(cfg, section), key)
        if path and not Path(path).is_file():
            raise ConfigError(f"{section}.{key}", f"no such file: {path}")
    return base_model.locate(cfg.checkpoint.restore_from) if cfg.checkpoint.restore_from else None


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


def tokenizer_vocab(cfg: Config, section: str) -> Config:
    """`cfg` with a vocabulary of "auto" sized from the tokenizer `cfg.<section>` encodes its data with (its own
    or the base's; a base's architecture, adopted first, already fixes it)."""
    if cfg.model.vocab_size != AUTO_VOCAB:
        return cfg
    base = base_model.locate(cfg.checkpoint.restore_from) if cfg.checkpoint.restore_from else None
    path = tokenizer_path(cfg, base, section)
    with data_errors(section):
        size = load_tokenizer(path).vocab_size
    return resolve_vocab_size(cfg, size, str(path))


def check_vocab(cfg: Config, manifest: dict, tokenizer: Path) -> None:
    """The prepared data's tokenizer fits the model's vocabulary (sized before the objective is built)."""
    if cfg.model.vocab_size == AUTO_VOCAB:
        raise ConfigError("model.vocab_size", "auto is sized before the objective is built "
                                              "(jaxllm.launch.train.resolve): resolve the config first")
    resolve_vocab_size(cfg, manifest["vocab_size"], str(tokenizer))  # raises when the tokenizer is larger


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
