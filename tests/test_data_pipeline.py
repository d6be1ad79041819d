"""Packed batches: exact packing rule, determinism, worker/process independence, resume, eval coverage."""
import pickle

import numpy as np
import pytest

from jaxllm.data.pipeline import (FIELDS, MixtureRows, PackedRows, auto_num_workers, make_eval_batches,
                                  make_mixture_iterator, make_train_iterator, packing_efficiency, rows_of_step)
from jaxllm.data.token_store import TokenStore, write_token_store

VOCAB = 5000


def _make_store(path, lengths_by_split):
    """Docs whose tokens are unique-ish so misplacement shows: doc i = [bos, 4 + (i*37 + k) % ..., eos]."""
    splits = {}
    for name, lengths in lengths_by_split.items():
        docs = []
        for i, n in enumerate(lengths):
            body = 4 + (np.arange(max(n - 2, 0)) + 97 * i) % (VOCAB - 4)
            docs.append(np.concatenate([[2], body, [3]])[:n] if n else np.zeros(0, np.int64))
        splits[name] = docs
    tok = path.parent / f"{path.name}.model"
    tok.write_bytes(b"x")
    write_token_store(path, splits, tokenizer_path=tok, vocab_size=VOCAB, bos_id=2, eos_id=3, pad_id=0)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(2, 90, size=200)) + [0, 1, 2]  # includes degenerate documents
    return _make_store(tmp_path_factory.mktemp("st") / "store", {"train": lengths, "eval": list(rng.integers(2, 60, size=23))})


def _reference_rows(split, seq_len, seed, shuffle, epoch):
    """Brute force: build the whole epoch stream with per-token doc ids/positions, then cut windows."""
    n = split.num_docs
    perm = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    docs = [split.doc(int(i)) for i in perm]
    stream = np.concatenate(docs)
    doc_of = np.concatenate([np.full(len(d), k) for k, d in enumerate(docs)])
    pos_of = np.concatenate([np.arange(len(d)) for d in docs])
    R = (len(stream) - 1) // seq_len
    rows = []
    for j in range(R):
        w = slice(j * seq_len, j * seq_len + seq_len + 1)
        d = doc_of[w]
        _, first = np.unique(d[:-1], return_index=True)
        seg = np.searchsorted(np.sort(first), np.arange(seq_len), side="right")
        rows.append(dict(tokens=stream[w][:-1], targets=stream[w][1:], segment_ids=seg,
                         positions=pos_of[w][:-1], loss_mask=(d[:-1] == d[1:]).astype(int)))
    return stream, rows


def test_hand_made_example(tmp_path):
    path = _make_store(tmp_path / "s", {"train": [3, 5, 7]})
    rows = PackedRows(TokenStore.open(path).split("train"), seq_len=4, seed=0, shuffle=False)
    assert len(rows) == (15 - 1) // 4 == 3
    r0, r1, r2 = rows[0], rows[1], rows[2]
    assert r0["segment_ids"].tolist() == [1, 1, 1, 2]
    assert r0["positions"].tolist() == [0, 1, 2, 0]
    assert r0["loss_mask"].tolist() == [1, 1, 0, 1]  # doc 0's EOS must not predict doc 1's BOS
    assert r0["tokens"].tolist()[:4] == [2, 4, 3, 2] and r0["targets"].tolist() == [4, 3, 2, 101]
    assert r1["segment_ids"].tolist() == [1, 1, 1, 1]
    assert r1["positions"].tolist() == [1, 2, 3, 4]  # doc 1 continues its count from row 0
    assert r1["loss_mask"].tolist() == [1, 1, 1, 0]
    assert r2["positions"].tolist() == [0, 1, 2, 3] and r2["loss_mask"].tolist() == [1, 1, 1, 1]
    assert all(v.dtype == np.int32 and v.shape == (4,) for v in r0.values())


@pytest.mark.parametrize("seq_len,shuffle", [(16, True), (33, False), (7, True)])
def test_matches_reference_over_two_epochs(store, seq_len, shuffle):
    split = TokenStore.open(store).split("train")
    rows = PackedRows(split, seq_len, seed=5, shuffle=shuffle)
    R = len(rows)
    for epoch in (0, 1):
        stream, ref = _reference_rows(split, seq_len, 5, shuffle, epoch)
        got = rows.get_rows(np.arange(epoch * R, (epoch + 1) * R))
        # Every token of the epoch's stream lies in exactly one row, in order.
        np.testing.assert_array_equal(got["tokens"].reshape(-1), stream[:R * seq_len])
        np.testing.assert_array_equal(got["targets"][:, :-1], got["tokens"][:, 1:])
        for f in FIELDS:
            np.testing.assert_array_equal(got[f], np.stack([r[f] for r in ref]), err_msg=f"{f} epoch {epoch}")
    if shuffle:  # epochs really are reshuffled
        assert not np.array_equal(rows.get_rows(np.arange(R))["tokens"], got["tokens"])


def test_pickled_rows_are_identical(store):
    rows = PackedRows(TokenStore.open(store).split("train"), 16, seed=1)
    again = pickle.loads(pickle.dumps(rows))
    idx = np.array([0, 5, 700, 3000])
    for f in FIELDS:
        np.testing.assert_array_equal(rows.get_rows(idx)[f], again.get_rows(idx)[f])


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for f in FIELDS:
            np.testing.assert_array_equal(x[f], y[f])


def test_train_iterator_determinism_and_sharding(store):
    kw = dict(global_batch_size=8, seq_len=16, num_steps=100)
    a = _take(make_train_iterator(store, seed=3, **kw), 5)
    assert a[0]["tokens"].shape == (8, 16) and all(v.dtype == np.int32 for v in a[0].values())
    _assert_same(a, _take(make_train_iterator(store, seed=3, **kw), 5))
    b = _take(make_train_iterator(store, seed=4, **kw), 5)
    assert not np.array_equal(a[0]["tokens"], b[0]["tokens"])
    # Step s is rows [s*B, (s+1)*B) of PackedRows.
    rows = PackedRows(TokenStore.open(store).split("train"), 16, seed=3)
    np.testing.assert_array_equal(a[2]["tokens"], rows.get_rows(np.arange(16, 24))["tokens"])
    # Two processes' local batches, concatenated, are the one-process batch.
    p0 = _take(make_train_iterator(store, seed=3, process_index=0, process_count=2, **kw), 5)
    p1 = _take(make_train_iterator(store, seed=3, process_index=1, process_count=2, **kw), 5)
    _assert_same(a, [{f: np.concatenate([x[f], y[f]]) for f in FIELDS} for x, y in zip(p0, p1)])
    with pytest.raises(ValueError, match="divisible"):
        make_train_iterator(store, seed=3, process_count=3, **kw)


def test_train_iterator_ends_at_num_steps_and_spans_epochs(store):
    it = make_train_iterator(store, global_batch_size=64, seq_len=64, seed=0, start_step=2, num_steps=6)
    batches = list(it)
    assert len(batches) == 4  # steps 2..5; 64*6 rows > one epoch (~100 rows), so epochs wrap
    assert all(packing_efficiency(b) == 1.0 for b in batches)


def test_resume_from_state_and_from_start_step(store):
    kw = dict(global_batch_size=4, seq_len=16, seed=9, num_steps=50)
    it = make_train_iterator(store, **kw)
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 4)
    fresh = make_train_iterator(store, **kw)
    fresh.set_state(state)
    _assert_same(expected, _take(fresh, 4))
    _assert_same(expected, _take(make_train_iterator(store, start_step=3, **kw), 4))


def test_workers_give_identical_batches_and_resume(store):
    kw = dict(global_batch_size=4, seq_len=16, seed=2, num_steps=40)
    serial = _take(make_train_iterator(store, **kw), 6)
    it = make_train_iterator(store, num_workers=2, **kw)
    try:
        par = _take(it, 3)
        state = it.get_state()
        par += _take(it, 3)
    finally:
        if hasattr(it, "close"):
            it.close()
    _assert_same(serial, par)
    again = make_train_iterator(store, **kw)  # a worker-made state restores in a serial iterator too
    again.set_state(state)
    _assert_same(serial[3:], _take(again, 3))


def test_eval_batches_cover_every_row_once(store):
    split = TokenStore.open(store).split("eval")
    seq_len, bs = 8, 5
    rows = PackedRows(split, seq_len, shuffle=False)
    R = len(rows)
    assert R % bs, "pick sizes so the last batch is padded"
    batches = make_eval_batches(store, batch_size=bs, seq_len=seq_len)
    listed = list(batches)
    assert len(listed) == len(batches) == -(-R // bs)
    _assert_same(listed, list(batches))  # re-iterable, same each time
    stacked = {f: np.concatenate([b[f] for b in listed]) for f in FIELDS}
    stream, ref = _reference_rows(split, seq_len, 0, False, 0)
    for f in FIELDS:
        np.testing.assert_array_equal(stacked[f][:R], np.stack([r[f] for r in ref]))
        assert not stacked[f][R:].any()  # pad rows: all zeros, so loss_mask 0 and segment_ids 0
    assert packing_efficiency(listed[0]) == 1.0
    assert packing_efficiency(listed[-1]) == pytest.approx((R % bs) / bs)
    assert len(make_eval_batches(store, batch_size=bs, seq_len=seq_len, max_batches=2)) == 2
    # Two processes split each eval batch.
    halves = [list(make_eval_batches(store, batch_size=4, seq_len=seq_len, process_index=p, process_count=2))
              for p in (0, 1)]
    whole = list(make_eval_batches(store, batch_size=4, seq_len=seq_len))
    _assert_same(whole, [{f: np.concatenate([x[f], y[f]]) for f in FIELDS} for x, y in zip(*halves)])


def test_too_short_split_is_a_clear_error(tmp_path):
    path = _make_store(tmp_path / "s", {"train": [3, 4]})
    with pytest.raises(ValueError, match=r"'train'.*7 tokens.*seq_len 16"):
        make_eval_batches(path, split="train", batch_size=2, seq_len=16)


def test_state_is_portable_and_checked(store):
    kw = dict(global_batch_size=4, seq_len=16, num_steps=50)
    it = make_train_iterator(store, seed=1, **kw)
    _take(it, 2)
    state = it.get_state()
    assert state["step"] == 2
    import json
    restored = make_train_iterator(store, seed=1, process_index=1, process_count=2, **kw)
    restored.set_state(json.loads(json.dumps(state)))  # survives JSON (what grain/orbax checkpoints write)
    np.testing.assert_array_equal(next(restored)["tokens"], next(it)["tokens"][2:])
    with pytest.raises(ValueError, match="seed"):
        make_train_iterator(store, seed=2, **kw).set_state(state)


@pytest.mark.parametrize("procs", [1, 2, 4])
def test_process_shards_are_disjoint_and_cover_the_epoch(store, procs):
    """Over one epoch, processes' rows are disjoint, and together they hold every token of the epoch stream
    in order: every document is covered, except any lying wholly in the < seq_len + 1 token tail that the
    epoch's last full row leaves (the next epoch's permutation puts different documents there)."""
    B, T, seed = 8, 16, 7
    split = TokenStore.open(store).split("train")
    rows = PackedRows(split, T, seed)
    R = len(rows)
    steps = -(-R // B)
    its = [make_train_iterator(store, global_batch_size=B, seq_len=T, seed=seed, num_steps=steps,
                               process_index=p, process_count=procs, num_workers=0) for p in range(procs)]
    owned = {}
    tokens = {}
    for s in range(steps):
        for p, it in enumerate(its):
            ids = rows_of_step(s, B, p, procs)
            batch = next(it)
            for r, tok in zip(ids.tolist(), batch["tokens"]):
                assert r not in owned
                owned[r] = p
                tokens[r] = tok
    assert set(range(R)) <= set(owned)
    stream, _ = _reference_rows(split, T, seed, True, 0)
    got = np.concatenate([tokens[r] for r in range(R)])
    np.testing.assert_array_equal(got, stream[:R * T])
    perm = np.random.default_rng([seed, 0]).permutation(split.num_docs)
    starts = np.concatenate([[0], np.cumsum(split.doc_lengths[perm])])
    covered = {int(perm[k]) for k in range(split.num_docs) if starts[k] < R * T or split.doc_lengths[perm[k]] == 0}
    tail_docs = set(range(split.num_docs)) - covered
    tail = split.num_tokens - R * T
    assert 1 <= tail <= T  # R = (N - 1) // T rows use all but the last 1..T tokens (a row reads T + 1)
    assert sum(int(split.doc_lengths[d]) for d in tail_docs) <= tail  # uncovered documents lie wholly in the tail


def test_mixture_proportions_determinism_and_resume(tmp_path, store):
    other = _make_store(tmp_path / "b", {"train": [50] * 40})
    mix = MixtureRows([PackedRows(TokenStore.open(p).split("train"), 16, 3) for p in (store, other)], [0.7, 0.3], 3)
    src, local = mix.assign(np.arange(10_000))
    assert abs((src == 0).mean() - 0.7) < 0.02 and abs((src == 1).mean() - 0.3) < 0.02
    for i in (0, 1):  # each source's rows are used in order, none skipped or repeated
        np.testing.assert_array_equal(local[src == i], np.arange((src == i).sum()))
    kw = dict(global_batch_size=8, seq_len=16, seed=3, num_steps=30, num_workers=0)
    a = _take(make_mixture_iterator([(store, 0.7), (other, 0.3)], **kw), 6)
    ref = mix.get_rows(np.arange(8, 16))
    np.testing.assert_array_equal(a[1]["tokens"], ref["tokens"])
    it = make_mixture_iterator([(store, 0.7), (other, 0.3)], **kw)
    _take(it, 3)
    state = it.get_state()
    fresh = make_train_iterator([(store, 0.7), (other, 0.3)], **kw)
    fresh.set_state(state)
    _assert_same(a[3:], _take(fresh, 3))
    with pytest.raises(ValueError, match="mixture_weights"):
        make_mixture_iterator([(store, 0.5), (other, 0.5)], **kw).set_state(state)
    with pytest.raises(ValueError, match="weights"):
        make_mixture_iterator([(store, -1.0), (other, 0.5)], **kw)


def test_auto_num_workers():
    assert auto_num_workers(2, "linux") == 0 and auto_num_workers(16, "linux") == 4
    assert auto_num_workers(64, "linux") == 4 and auto_num_workers(64, "darwin") == 0
    assert make_train_iterator.__kwdefaults__["num_workers"] is None
