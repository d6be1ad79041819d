"""Batched autoregressive decoding with a KV cache: greedy, temperature, top-k, top-p, stop tokens.

Prompts are LEFT-padded to a common length P: every row's next token then goes into the same cache slot, so
one scalar write index serves the batch. Row b's real tokens start at slot `start_B[b]`; its positions count
from there and the slots before it are masked out, so padding changes nothing a row computes.

The prefill and the whole token loop (a `lax.while_loop` that exits once every row has stopped) run in one
jitted call. Shapes are bucketed to powers of two (batch, prompt length, cache length) and the sampling knobs
and `max_new_tokens` are traced values, so new prompt lengths and settings rarely recompile (whether top-k or
top-p truncate at all is static: a draw without them skips the sort that makes them exact).

A model's vocabulary may be larger than its tokenizer's (padded to a multiple of 128 for speed): `vocab_limit`,
the tokenizer's size, keeps the padding ids out of every draw, so no id the tokenizer cannot decode comes out.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxllm.model.transformer import KVCache

MIN_BUCKET = 16
STOP_SLOTS = 8  # stop ids are padded to a multiple of this (with -1, never sampled) to keep shapes stable
NO_TOKEN = -1  # output entry of a row that had already stopped
ALL_IDS = 2**31 - 1  # vocab_limit of None: every id of the model may be drawn


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def draw_tokens(logits_BV, key, step, temperature, top_k, top_p, vocab_limit, sampling: bool,
                truncate: bool = True):
    """Next tokens [B] and their log-probabilities [B] (float32), drawn from the ids below `vocab_limit` only.

    Greedy: the argmax, with its log-probability under softmax(logits). Sampling: a draw from the
    temperature-scaled top-k / top-p (nucleus) distribution, with its log-probability under the whole
    softmax(logits / temperature), not the truncated one: that is what a forward pass over the sampled sequence
    gives back, the quantity PPO's probability ratio needs (jaxllm.objectives.rollout). The padding ids above
    `vocab_limit` are one more truncation: they stay in that softmax and out of the draw. `truncate` False (no
    top-k, no top-p: a static choice) draws from the drawable ids directly, without the sort that makes top-k and
    top-p exact: the same distribution (other draws for a given key), and no O(V log V) per row and step.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    rank_V = jnp.arange(logits_BV.shape[-1])
    drawable_BV = jnp.where(rank_V < vocab_limit, logits_BV, -jnp.inf)
    if not sampling:
        token_B = jnp.argmax(drawable_BV, axis=-1).astype(jnp.int32)
        return token_B, _logp_of(logits_BV, token_B)
    logits_BV = logits_BV / temperature
    if not truncate:
        choice_B = jax.random.categorical(jax.random.fold_in(key, step),
                                          jnp.where(rank_V < vocab_limit, logits_BV, -jnp.inf))
        token_B = choice_B.astype(jnp.int32)
        return token_B, _logp_of(logits_BV, token_B)
    # Work in sorted order so top-k is exact (ties cannot let extra tokens in) and k may be a traced value; the
    # padding ids sort last, so ranks from `vocab_limit` on are exactly them.
    order_BV = jnp.argsort(-drawable_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    keep_BV = jnp.broadcast_to(((top_k <= 0) | (rank_V < top_k)) & (rank_V < vocab_limit), sorted_BV.shape)
    probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
    # Nucleus: keep a token if the tokens ranked above it hold less than top_p (the first is always kept).
    keep_BV &= (jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p
    choice_B = jax.random.categorical(jax.random.fold_in(key, step), jnp.where(keep_BV, sorted_BV, -jnp.inf))
    token_B = jnp.take_along_axis(order_BV, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return token_B, _logp_of(logits_BV, token_B)


def _logp_of(logits_BV, token_B):
    # The arithmetic of jaxllm.model.head.token_logps (target logit - logsumexp), so that a forward pass
    # over the sampled tokens rounds the same way.
    target_B = jnp.take_along_axis(logits_BV, token_B[:, None], axis=-1)[:, 0]
    return target_B - jax.nn.logsumexp(logits_BV, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "sampling", "truncate"))
def _decode(graphdef, params, tokens_BP, start_B, max_new, stop_ids, temperature, top_k, top_p, vocab_limit, key,
            *, cache_len: int, sampling: bool, truncate: bool = True):
    """Prefill + token loop; returns [B, cache_len - P] new tokens (NO_TOKEN after a row stopped) and their
    log-probabilities (0 after a row stopped)."""
    model = nnx.merge(graphdef, params)
    B, P = tokens_BP.shape
    pick = functools.partial(draw_tokens, key=key, temperature=temperature, top_k=top_k, top_p=top_p,
                             vocab_limit=vocab_limit, sampling=sampling, truncate=truncate)

    cache = KVCache.zeros(model.cfg, B, cache_len, model.compute_dtype)
    layers = model.decode_layers()  # unrolled layers' weights, sliced once ahead of the loop (None: scanned)
    logits_BV, cache = model.decode(tokens_BP, cache, 0, start_B, layers)
    token_B, logp_B = pick(logits_BV, step=0)
    out_BN = jnp.full((B, cache_len - P), NO_TOKEN, jnp.int32).at[:, 0].set(token_B)
    logp_BN = jnp.zeros((B, cache_len - P), jnp.float32).at[:, 0].set(logp_B)
    done_B = jnp.isin(token_B, stop_ids)

    def cond(carry):
        step, _, _, done_B, _, _ = carry
        return (step < max_new) & ~jnp.all(done_B)

    def body(carry):
        step, cache, token_B, done_B, out_BN, logp_BN = carry
        # Token `step - 1` sits in slot P + step - 1; its logits give token `step`.
        logits_BV, cache = model.decode(token_B[:, None], cache, P + step - 1, start_B, layers)
        new_B, logp_B = pick(logits_BV, step=step)
        out_BN = out_BN.at[:, step].set(jnp.where(done_B, NO_TOKEN, new_B))
        logp_BN = logp_BN.at[:, step].set(jnp.where(done_B, 0.0, logp_B))
        # A stopped row keeps feeding its last token: shapes stay fixed and its output no longer changes.
        token_B = jnp.where(done_B, token_B, new_B)
        return step + 1, cache, token_B, done_B | jnp.isin(new_B, stop_ids), out_BN, logp_BN

    carry = (jnp.int32(1), cache, token_B, done_B, out_BN, logp_BN)
    return jax.lax.while_loop(cond, body, carry)[-2:]


def left_pad(prompts: Sequence[Sequence[int]], batch: int | None = None,
             length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-padded to length P: (tokens [B, P] int32, start_B [B], each row's first real slot). P is
    `length` or the longest prompt rounded up to a power of two; B is `batch` or len(prompts) rounded up to a
    power of two; filler rows hold one pad token."""
    B, P = batch or bucket(len(prompts), 1), length or bucket(max(len(p) for p in prompts))
    tokens_BP = np.zeros((B, P), np.int32)
    start_B = np.full((B,), P - 1, np.int32)
    for b, prompt in enumerate(prompts):
        tokens_BP[b, P - len(prompt):] = prompt
        start_B[b] = P - len(prompt)
    return tokens_BP, start_B


def decode(graphdef, params, tokens_BP, start_B, *, max_new_tokens: int, stop_ids: Sequence[int] = (),
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, vocab_limit: int | None = None, key=None):
    """The jitted prefill and token loop on left-padded prompts (`left_pad`): (new tokens [B, N], their
    log-probabilities [B, N]) as device arrays, N = the cache bucket less P (>= max_new_tokens); NO_TOKEN and 0
    after a row stopped (its stop token is kept). Settings as `generate`'s; `key` a jax PRNG key."""
    stops = np.full((bucket(len(stop_ids), STOP_SLOTS),), NO_TOKEN, np.int32)
    stops[: len(stop_ids)] = list(stop_ids)
    key = jax.random.key(0) if key is None else key
    return _decode(graphdef, params, jnp.asarray(tokens_BP), jnp.asarray(start_B), jnp.int32(max_new_tokens),
                   jnp.asarray(stops), jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), jnp.float32(top_p),
                   jnp.int32(ALL_IDS if vocab_limit is None else vocab_limit), key,
                   cache_len=bucket(tokens_BP.shape[1] + max_new_tokens), sampling=temperature > 0,
                   truncate=top_k > 0 or top_p < 1.0)


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int = 0,
             vocab_limit: int | None = None, keep_stop: bool = False) -> list[list[int]]:
    """Extend each prompt by up to `max_new_tokens` tokens; returns the new ids per prompt.

    `model` is a jaxllm Transformer or a `(graphdef, params)` pair (params may be sharded: call under
    `jax.set_mesh(mesh)`). `temperature=0` is greedy; otherwise tokens are drawn from the softmax of
    logits/temperature restricted to the `top_k` most likely (0: no limit) and to the smallest set holding
    `top_p` of the probability. A row ends at its first token in `stop_ids`, which is not included in its
    output (with `keep_stop` it is: its text may hold more than the stop, as a stop string's token does). Only
    ids below `vocab_limit` (the tokenizer's size; None: any id of the model) are drawn. The same `seed` and inputs
    give the same samples.
    """
    graphdef, params = nnx.split(model) if isinstance(model, nnx.Module) else model
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if max_new_tokens <= 0 or not prompts:
        return [[] for _ in prompts]
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"generate: need temperature >= 0, 0 < top_p <= 1, top_k >= 0 "
                         f"(got {temperature}, {top_p}, {top_k})")
    tokens_BP, start_B = left_pad(prompts)
    out_BN, _ = decode(graphdef, params, tokens_BP, start_B, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                       temperature=temperature, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit,
                       key=jax.random.key(seed))
    out_BN = np.asarray(multihost_utils.process_allgather(out_BN, tiled=True))  # every process reads all rows
    stops = set(stop_ids)
    results = []
    for row in out_BN[: len(prompts), :max_new_tokens]:
        new: list[int] = []
        for token in row.tolist():
            if token == NO_TOKEN or (token in stops and not keep_stop):
                break
            new.append(token)
            if token in stops:
                break
        results.append(new)
    return results


def greedy_generate(graphdef, params, prompt_ids, max_new_tokens: int, *, eos_id: int | None = None,
                    max_len: int = 256, vocab_limit: int | None = None) -> list[int]:
    """Greedily extend `prompt_ids` by up to `max_new_tokens` tokens (stopping at `eos_id`, drawing only ids
    below `vocab_limit`); returns the new ids.

    The prompt is cut to its last `max_len - max_new_tokens` tokens (at least one), so that prompt and output
    together stay within `max_len` positions, the model's training length.
    """
    if not prompt_ids:
        raise ValueError("greedy_generate needs at least one prompt token")
    window = list(prompt_ids)[-max(1, max_len - max_new_tokens):]
    stop_ids = () if eos_id is None else (eos_id,)
    return generate((graphdef, params), [window], max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                    vocab_limit=vocab_limit)[0]
