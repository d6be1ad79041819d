"""Pretraining as an objective: the Llama LM, every parameter trainable, next-token cross-entropy on packed rows
of a token store.

A batch is a dict of int32 arrays [B, T]: `tokens`, `targets`, `segment_ids`, `positions`, `loss_mask`; the loss
counts target tokens with `loss_mask == 1` (SFT reuses it with the mask on response tokens only).
"""

from __future__ import annotations

import dataclasses
import functools


from jaxllm.config.schema import (AUTO_VOCAB, Config, ConfigError, DataConfig, LoRAConfig, ModelConfig,
                                  PipelineConfig, PrecisionConfig, resolve_vocab_size)
from jaxllm.data.cold_cache import ChunkCache
from jaxllm.data.pipeline import make_eval_batches, make_train_iterator
from jaxllm.data.token_store import TokenStore
from jaxllm.data.tokenizer import Tokenizer, load_tokenizer
from jaxllm.model.head import next_token_loss
from jaxllm.model.lora import trainable as lora_trainable
from jaxllm.train.faults import ThrottledBatches, with_scaled_router, with_zeroed_layer
from jaxllm.train.objective import BatchRequest, Objective
from jaxllm.train.state import TrainState, abstract_objective_state, init_objective_state
from jaxllm.model.build import build_model


def lm_objective(model: ModelConfig, precision: PrecisionConfig, pipeline: PipelineConfig = PipelineConfig(),
                 lora: LoRAConfig | None = None, rope_scaling=None, sequence_parallel: bool = False) -> Objective:
    """The model-and-loss half of language modelling (no data): what the train step needs. With `lora` (rank >
    0) the model carries adapters and only they train; `sequence_parallel` as `build_model`."""
    return Objective(name="pretrain", build_model=functools.partial(build_model, model, precision,
                                                                     pipeline=pipeline, lora=lora,
                                                                     rope_scaling=rope_scaling,
                                                                     sequence_parallel=sequence_parallel),
                     loss_fn=next_token_loss, trainable=lora_trainable(lora))


def data_cache(data: DataConfig, slow_mb_s: float = 0.0) -> ChunkCache | None:
    """The local cache the run's token stores are read through (`data.cache_dir`), or None."""
    if not data.cache_dir:
        return None
    return ChunkCache(data.cache_dir, int(data.cache_gb * 1e9), slow_mb_s)


def open_store(key: str, path: str, cache: ChunkCache | None) -> TokenStore:
    """The token store at `path` (config key `key`); a missing or unreadable one is a ConfigError."""
    try:
        return TokenStore.open(path, cache)
    except FileNotFoundError:
        raise ConfigError(key, f"no token store at {path} (run `make data` or scripts/prepare_data.py)") from None
    except (ValueError, OSError) as exc:
        raise ConfigError(key, f"{exc}") from None


def open_data(cfg: Config) -> tuple[TokenStore, Tokenizer]:
    """The token store and its tokenizer, checked against the model's vocabulary, and the stores of a mixture
    against that tokenizer."""
    cache = data_cache(cfg.data)
    store = open_store("data.path", cfg.data.path, cache)
    check_rows_fit(store, cfg.train.seq_len)
    for path, _ in cfg.data.mixture_pairs():
        member = open_store("data.mixture", path, cache)
        check_rows_fit(member, cfg.train.seq_len, ("train",))
        if member.manifest.get("tokenizer_sha256") != store.manifest.get("tokenizer_sha256"):
            raise ConfigError("data.mixture", f"{path} was tokenized with another tokenizer than data.path "
                                              f"{cfg.data.path}: every store of a mixture needs the run's tokenizer")
    tokenizer = load_tokenizer(str(store.root / store.manifest.get("tokenizer", "tokenizer.model")))
    resolve_vocab_size(cfg, tokenizer.vocab_size, cfg.data.path)
    return store, tokenizer


def with_store_vocab(cfg: Config) -> Config:
    """`cfg` with model.vocab_size "auto" sized from the manifest of the token store at data.path (no data read:
    plans use it too); a ConfigError when there is no store to size it from."""
    if cfg.model.vocab_size != AUTO_VOCAB:
        return cfg
    try:
        tokenizer_size = TokenStore.open(cfg.data.path, data_cache(cfg.data)).manifest["vocab_size"]
    except FileNotFoundError:
        raise ConfigError("model.vocab_size", f"auto takes the tokenizer's size from the token store at data.path, "
                                              f"and there is none at {cfg.data.path}: give a number to run without "
                                              f"it") from None
    except (ValueError, OSError) as exc:
        raise ConfigError("model.vocab_size", f"auto: {exc}") from None
    return resolve_vocab_size(cfg, tokenizer_size, f"{cfg.data.path}/manifest.json")


def check_rows_fit(store: TokenStore, seq_len: int, splits: tuple[str, ...] = ("train", "eval")) -> None:
    """Each of the run's `splits` (those the store has) holds at least one row of `seq_len` + 1 tokens."""
    for name in splits:
        if name not in store.split_names:
            continue
        tokens = store.split(name).num_tokens
        if tokens < seq_len + 1:
            raise ConfigError("train.seq_len", f"{seq_len} is longer than split {name!r} of {store.root}: a row "
                                               f"needs seq_len + 1 = {seq_len + 1} tokens, the split has {tokens}")


def pretrain_objective(cfg: Config) -> Objective:
    """Pretraining on `cfg.data.path`: batches are a pure function of (seed, data index), whatever the process
    count; held-out batches come from the store's eval split."""
    _, tokenizer = open_data(cfg)
    tc = cfg.train
    cache = data_cache(cfg.data, cfg.debug.slow_cold_mb_s)
    train_stores = cfg.data.mixture_pairs() or cfg.data.path

    def open_batches(request: BatchRequest):
        index, count = request.rows
        source = make_train_iterator(train_stores, split="train", global_batch_size=tc.batch_size,
                                     seq_len=tc.seq_len, seed=tc.seed, process_index=index, process_count=count,
                                     start_step=request.first, num_steps=request.end,
                                     num_workers=cfg.data.num_workers, cache=cache,
                                     prefetch_steps=cfg.data.prefetch_steps)
        return ThrottledBatches(source, cfg.debug.data_sleep_s) if cfg.debug.data_sleep_s > 0 else source

    def eval_batches(rows):
        index, count = rows
        return list(make_eval_batches(cfg.data.path, split="eval", batch_size=tc.batch_size, seq_len=tc.seq_len,
                                      max_batches=tc.eval_batches or None, process_index=index,
                                      process_count=count, cache=cache))

    objective = dataclasses.replace(lm_objective(cfg.model, cfg.precision, cfg.pipeline,
                                                 sequence_parallel=cfg.mesh.sequence_parallel),
                                    open_batches=open_batches, eval_batches=eval_batches, tokenizer=tokenizer)
    if cfg.debug.router_scale != 1:
        objective = with_scaled_router(objective, cfg.debug.router_scale)
    return with_zeroed_layer(objective, cfg.debug.zero_layer) if cfg.debug.zero_layer >= 0 else objective


def abstract_train_state(cfg: ModelConfig, precision: PrecisionConfig, tx, window: int = 50) -> TrainState:
    """Shapes and dtypes of the language model's whole train state, without allocating it."""
    return abstract_objective_state(lm_objective(cfg, precision), tx, window)[0]


def create_train_state(cfg: ModelConfig, precision: PrecisionConfig, tx, mesh, seed: int, window: int = 50,
                       pipeline: PipelineConfig = PipelineConfig()):
    """The language model's train state initialised directly into its shards on `mesh`.

    Returns (graphdef, state, state_shardings); `nnx.merge(graphdef, state.params)` rebuilds the model (the
    pipeline schedule lives in the graphdef; parameters are laid out the same for every schedule).
    """
    objective = lm_objective(cfg, precision, pipeline)
    state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed, window)
    return objective.graphdef, state, shardings
