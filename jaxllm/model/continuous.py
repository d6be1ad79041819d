"""Continuous batching: decode Q left-padded prompts through S < Q cache rows ("slots"), refilling a row with the
next prompt once its response ends, instead of decoding all Q rows until the longest response ends.

Every slot advances in lockstep at one scalar token index w, so the model's KV-cache decode is used as it is
(`Transformer.decode`, one index for the batch), on a ring of C = P + N cache positions (bucketed; `ring`:
token w sits at position w % C, a row sees its last C tokens): a prompt taken into a slot at index w holds
indices [w - P, w) (prefilled on a fresh cache of its own and rotated into place; its row's start moved there, so
nothing earlier in the row is visible) and its first response token is fed at w with every other slot's next
token. A refill takes G = S // 2 free slots at once and prefills those G rows alone.

Each token is drawn with a key of its own, fold_in(fold_in(key, prompt), n): a prompt's response does not depend
on which slot serves it or when, so S only trades speed for memory (tests/test_continuous.py holds every S to the
same samples). Returns the format of `jaxllm.model.sample.decode`: new tokens [Q, N] (NO_TOKEN after a row
stopped, its stop token kept) and their log-probabilities [Q, N] (0 after).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.model.sample import ALL_IDS, NO_TOKEN, STOP_SLOTS, bucket, draw_tokens
from jaxllm.model.transformer import KVCache


class _Slots(NamedTuple):
    """The decode loop's state: the cache rows [S] and what each serves, the outputs [Q, N], the write index."""

    cache: KVCache
    prompt_S: jax.Array  # the prompt a slot serves (Q: none)
    drawn_S: jax.Array  # its response tokens drawn so far
    token_S: jax.Array  # its last token, fed at the next step
    start_S: jax.Array  # its prompt's first real cache position
    free_S: jax.Array  # its response ended (or it never had one): it takes the next prompt
    out_QN: jax.Array
    logp_QN: jax.Array
    next_q: jax.Array  # the first prompt no slot has taken yet
    w: jax.Array  # the cache position the next token goes to


def refill_group(slots: int) -> int:
    """How many free slots a refill takes at once."""
    return max(1, slots // 2)


def max_steps(prompts: int, slots: int, max_new: int) -> int:
    """The decode steps `continuous_decode` takes at most: after the first fill, a refill at least every N steps
    (every response ends within N tokens), ceil((Q - S) / G) of them, and N steps after the last."""
    return max_new * (1 + math.ceil(max(prompts - slots, 0) / refill_group(slots)))


@functools.partial(jax.jit, static_argnames=("graphdef", "slots", "max_new", "cache_len", "sampling", "truncate"))
def _continuous(graphdef, params, tokens_QP, start_Q, stop_ids, temperature, top_k, top_p, vocab_limit, key, *,
                slots: int, max_new: int, cache_len: int, sampling: bool, truncate: bool):
    model = nnx.merge(graphdef, params)
    Q, P = tokens_QP.shape
    S, G, N = slots, refill_group(slots), max_new
    scanned = model.cfg.scan_layers
    layers = model.decode_layers()  # unrolled layers' weights, sliced once ahead of the loop (None: scanned)
    layer_parts = None if layers is None else [nnx.split(layer) for layer in layers]

    def after(state: _Slots):
        """(state, the model and its decode layers) with the weights' uses ordered after `state`: a sharded model's
        decode gathers its weights with collectives that do not depend on the slots, and XLA:CPU could otherwise
        run those of the next step beside the refill's on some devices and after it on others (a wedge)."""
        weights = (params, None if layer_parts is None else [state for _, state in layer_parts])
        state, (params_now, layer_states) = jax.lax.optimization_barrier((state, weights))
        decode_layers = None if layers is None else tuple(
            nnx.merge(graph, now) for (graph, _), now in zip(layer_parts, layer_states))
        return state, nnx.merge(graphdef, params_now), decode_layers

    def draw(logits_RV, prompt_R, drawn_R):
        """Each row's next token and its log-probability, with the key of (its prompt, its token index)."""
        keys = jax.vmap(lambda q, n: jax.random.fold_in(jax.random.fold_in(key, q), n))(prompt_R, drawn_R)
        one = lambda logits_V, k: draw_tokens(logits_V[None], k, 0, temperature, top_k, top_p, vocab_limit,
                                              sampling, truncate)
        token_R, logp_R = jax.vmap(one)(logits_RV, keys)
        return token_R[:, 0], logp_R[:, 0]

    def record(state: _Slots, rows_R, token_R, logp_R, write_R) -> _Slots:
        """Rows' drawn tokens into their prompts' outputs (where `write_R`), their slots advanced."""
        q_R = jnp.where(write_R, state.prompt_S[rows_R], Q)  # Q: dropped
        n_R = state.drawn_S[rows_R]
        out = state.out_QN.at[q_R, n_R].set(token_R, mode="drop")
        logp = state.logp_QN.at[q_R, n_R].set(logp_R, mode="drop")
        ended = jnp.isin(token_R, stop_ids) | (n_R + 1 >= N)
        keep = lambda new, old: jnp.where(write_R, new, old)
        return state._replace(out_QN=out, logp_QN=logp,
                              drawn_S=state.drawn_S.at[rows_R].set(keep(n_R + 1, n_R), mode="drop"),
                              token_S=state.token_S.at[rows_R].set(keep(token_R, state.token_S[rows_R]), mode="drop"),
                              free_S=state.free_S.at[rows_R].set(keep(ended, state.free_S[rows_R]), mode="drop"))

    def refill(state: _Slots, G: int = G) -> _Slots:
        """The next prompts into up to G free slots: prefilled on a fresh cache of those rows alone, rotated
        onto the ring at indices [w - P, w)."""
        rank_S = jnp.cumsum(state.free_S) - 1
        take_S = state.free_S & (rank_S < G) & (state.next_q + rank_S < Q)
        rows_G = jnp.nonzero(take_S, size=G, fill_value=S)[0]
        taken_G = rows_G < S
        q_G = jnp.minimum(state.next_q + jnp.arange(G), Q - 1)
        fresh = KVCache.zeros(model.cfg, G, cache_len, model.compute_dtype)
        logits_GV, fresh = model.decode(tokens_QP[q_G], fresh, 0, start_Q[q_G], layers)
        shift = jnp.mod(state.w - P, cache_len)  # the prompt's indices [w - P, w) on the ring
        rows_axis = 1 if scanned else 0

        def put(a, b):
            index = (slice(None),) * rows_axis + (rows_G,)
            return a.at[index].set(jnp.roll(b, shift, axis=rows_axis + 1), mode="drop")

        cache = jax.tree.map(put, state.cache, fresh)
        start_G = start_Q[q_G] + state.w - P
        state = state._replace(cache=cache,
                               prompt_S=state.prompt_S.at[rows_G].set(q_G, mode="drop"),
                               drawn_S=state.drawn_S.at[rows_G].set(0, mode="drop"),
                               start_S=state.start_S.at[rows_G].set(start_G, mode="drop"),
                               next_q=state.next_q + jnp.sum(taken_G))
        token_G, logp_G = draw(logits_GV, q_G, jnp.zeros_like(q_G))
        return record(state, rows_G, token_G, logp_G, taken_G)

    def step(state: _Slots) -> _Slots:
        """One token for every slot at position w (a free slot's is computed and dropped)."""
        state, model_now, layers_now = after(state)
        logits_SV, cache = model_now.decode(state.token_S[:, None], state.cache, state.w, state.start_S, layers_now,
                                            ring=True)
        state = state._replace(cache=cache)
        token_S, logp_S = draw(logits_SV, state.prompt_S, state.drawn_S)
        return record(state, jnp.arange(S), token_S, logp_S, ~state.free_S)._replace(w=state.w + 1)

    def wants_refill(state: _Slots):
        left = Q - state.next_q
        free = jnp.sum(state.free_S)
        return (left > 0) & ((free >= jnp.minimum(G, left)) | (free == S))

    def body(state: _Slots) -> _Slots:
        state = jax.lax.cond(wants_refill(state), refill, lambda s: s, state)
        return step(state)

    def cond(state: _Slots):
        busy = (state.next_q < Q) | ~jnp.all(state.free_S)
        return busy & (state.w < P + max_steps(Q, S, N))  # the bound holds: a guard, never the exit

    zeros_S = jnp.zeros((S,), jnp.int32)
    state = _Slots(KVCache.zeros(model.cfg, S, cache_len, model.compute_dtype), jnp.full((S,), Q, jnp.int32),
                   zeros_S, zeros_S, zeros_S, jnp.ones((S,), bool), jnp.full((Q, N), NO_TOKEN, jnp.int32),
                   jnp.zeros((Q, N), jnp.float32), jnp.int32(0), jnp.int32(P))
    state = jax.lax.while_loop(cond, body, refill(state, S))  # every slot filled at once to start
    return state.out_QN, state.logp_QN


def continuous_decode(graphdef, params, tokens_QP, start_Q, *, slots: int, max_new_tokens: int, stop_ids=(),
                      temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, vocab_limit: int | None = None,
                      key=None):
    """`jaxllm.model.sample.decode` through `slots` cache rows (see the module docstring; more slots than prompts:
    one for each prompt): (new tokens [Q, N], log-probabilities [Q, N]) as device arrays, N = `max_new_tokens`."""
    Q, P = np.shape(tokens_QP)
    if slots < 1:
        raise ValueError(f"continuous_decode: slots must be >= 1, got {slots}")
    slots = min(slots, Q)
    stops = np.full((bucket(len(stop_ids), STOP_SLOTS),), NO_TOKEN, np.int32)
    stops[: len(stop_ids)] = list(stop_ids)
    key = jax.random.key(0) if key is None else key
    return _continuous(graphdef, params, jnp.asarray(tokens_QP), jnp.asarray(start_Q), jnp.asarray(stops),
                       jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), jnp.float32(top_p),
                       jnp.int32(ALL_IDS if vocab_limit is None else vocab_limit), key, slots=slots,
                       max_new=max_new_tokens, cache_len=bucket(P + max_new_tokens),
                       sampling=temperature > 0, truncate=top_k > 0 or top_p < 1.0)
