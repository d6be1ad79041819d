"""Rollouts for RL post-training: the policy samples responses with the KV-cache sampler (jaxllm.model.sample), from
the same parameter arrays it trains (no copy of the weights), and records each sampled token's log-probability.

A rollout row is its left-padded prompt followed by the response slots, one sequence [P + N]: the layout the
sampler decodes in, so a full forward pass over it (`response_logps`) sees every token at the position the
sampler gave it. PPO's probability ratio rests on the two agreeing: at the first update of an iteration the
ratio must be 1 (tests/test_rollout.py checks them within 1e-5 in float32).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.model.head import head_stats
from jaxllm.model.continuous import continuous_decode
from jaxllm.model.sample import NO_TOKEN, decode


class Rollout(NamedTuple):
    """Sampled responses, device arrays. `tokens` [B, P + N] int32: the left-padded prompt (its first real slot
    `start` [B]) then the response, 0 in every slot that holds no token; `logps` [B, N] float32, each response
    token's log-probability when it was sampled (0 where `mask` is 0); `mask` [B, N] float32, 1 for the response
    tokens up to and including the first stop token; `stopped` [B] bool, whether the row ended at a stop token
    (False: it ran out of `max_new_tokens`)."""

    tokens: jax.Array
    start: jax.Array
    logps: jax.Array
    mask: jax.Array
    stopped: jax.Array

    @property
    def prompt_len(self) -> int:
        return self.tokens.shape[1] - self.logps.shape[1]


def rollout(graphdef, params, tokens_BP, start_B, *, max_new_tokens: int, temperature: float, stop_ids, key,
            top_k: int = 0, top_p: float = 1.0, vocab_limit: int | None = None, slots: int = 0) -> Rollout:
    """Sample a response to each left-padded prompt (`jaxllm.model.sample.left_pad`); settings as
    `jaxllm.model.sample.generate`'s. The recorded log-probabilities are under softmax(logits / temperature) over the
    whole vocabulary (top-k / top-p and `vocab_limit`, the tokenizer's size, only restrict the draw), what
    `response_logps` computes. `slots` > 0 decodes through that many cache rows, refilled as responses end
    (`jaxllm.model.continuous`); 0: every row at once until the longest response ends."""
    settings = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature, top_k=top_k,
                    top_p=top_p, vocab_limit=vocab_limit, key=key)
    if slots:
        new_BN, logps_BN = continuous_decode(graphdef, params, tokens_BP, start_B, slots=slots, **settings)
    else:
        new_BN, logps_BN = decode(graphdef, params, tokens_BP, start_B, **settings)
    valid_BN = new_BN != NO_TOKEN
    tokens = jnp.concatenate([jnp.asarray(tokens_BP), jnp.where(valid_BN, new_BN, 0)], axis=1)
    stopped = jnp.any(jnp.isin(new_BN, jnp.asarray(list(stop_ids), jnp.int32)) & valid_BN, axis=1)
    return Rollout(tokens, jnp.asarray(start_B), logps_BN, valid_BN.astype(jnp.float32), stopped)


def sequence_layout(tokens_BS, start_B):
    """(segment_ids, positions) [B, S] of left-padded rows: segment 1 from each row's first real slot (0, the
    padding segment, before it), positions counting from that slot, as the sampler's cache assigns them
    (rotary attention is shift-invariant, but the same positions round the same way)."""
    slots_S = jnp.arange(tokens_BS.shape[1], dtype=jnp.int32)
    real_BS = slots_S[None, :] >= start_B[:, None]
    return real_BS.astype(jnp.int32), jnp.maximum(slots_S[None, :] - start_B[:, None], 0)


def response_stats(model, tokens_BS, segment_ids_BS, positions_BS, prompt_len: int, temperature: float = 1.0,
                   rng=None, entropy: bool = False):
    """(log-probability [B, N] of each response token, entropy [B, N] or None) under softmax(logits /
    temperature), float32, from one forward pass over rows laid out by `sequence_layout`; the head runs chunk by
    chunk when `model.loss_chunk` is set (jaxllm/model/head.py)."""
    return response_stats_and_router(model, tokens_BS, segment_ids_BS, positions_BS, prompt_len, temperature, rng,
                                     entropy)[:2]


def response_stats_and_router(model, tokens_BS, segment_ids_BS, positions_BS, prompt_len: int,
                              temperature: float = 1.0, rng=None, entropy: bool = False):
    """(`response_stats`, a mixture of experts' router sums or None): the trained forward of an RL loss, whose
    router sums give the auxiliary losses (`jaxllm.model.head.with_router_penalty`)."""
    x_BSD, router = model.hidden_states_and_router(tokens_BS, segment_ids_BS, positions_BS, rng=rng)
    # Slot s predicts slot s + 1: response slot n (sequence slot P + n) is predicted from P + n - 1.
    return (*head_stats(model, x_BSD[:, prompt_len - 1:-1], tokens_BS[:, prompt_len:], temperature=temperature,
                        entropy=entropy), router)


def response_logps(model, tokens_BS, segment_ids_BS, positions_BS, prompt_len: int, temperature: float = 1.0,
                   rng=None):
    """Each response token's log-probability [B, N] under the model (float32): what `rollout` recorded for
    the policy that sampled, and the reference's and the updated policy's log-probs of the same tokens."""
    return response_stats(model, tokens_BS, segment_ids_BS, positions_BS, prompt_len, temperature, rng)[0]
