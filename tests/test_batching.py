"""Collation, packing and the reproducible, resumable batch stream."""
from __future__ import annotations

import pytest
import torch

from lit_qlora.data.batching import BatchStream, collate, count_packed_batches, epoch_order, pack_window
from lit_qlora.utils import UserError


def _sample(n: int, start: int = 10) -> dict:
    ids = torch.arange(start, start + n)
    return {"input_ids": ids, "labels": torch.cat([torch.full((1,), -100), ids[1:]])}


def test_collate_pads_right():
    batch = collate([_sample(3), _sample(5)], pad_id=0)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 5)
    assert batch["input_ids"][0].tolist() == [10, 11, 12, 0, 0]
    assert batch["labels"][0].tolist() == [-100, 11, 12, -100, -100]
    assert batch["input_ids"][1].tolist() == list(range(10, 15))
    padded = collate([_sample(3), _sample(5)], pad_id=7, ignore_index=-1, pad_multiple_of=8)
    assert padded["input_ids"].shape == (2, 8) and padded["input_ids"][1, 5:].tolist() == [7, 7, 7]
    assert padded["labels"][1, 5:].tolist() == [-1, -1, -1]


def test_batch_stream_reproducible_and_resumable():
    samples = [_sample(1 + i % 7, start=100 * i) for i in range(10)]
    first = lambda b: b["input_ids"][:, 0].tolist()  # noqa: E731 - sample identity
    a = BatchStream(samples, batch_size=4, seed=3)
    run = [first(next(a)) for _ in range(9)]  # 3 epochs of 4 + 4 + 2
    epoch0 = sorted(sum(run[:3], []))
    assert epoch0 == [100 * i for i in range(10)] and run[:3] != run[3:6]  # full coverage, reshuffled
    assert run == [first(b) for b, _ in zip(BatchStream(samples, 4, seed=3), range(9))]

    b = BatchStream(samples, batch_size=4, seed=3)
    for _ in range(4):
        next(b)
    state = b.state_dict()
    assert state == {"epoch": 1, "position": 4, "row": 0, "seed": 3}
    resumed = BatchStream(samples, batch_size=4, seed=99)
    resumed.load_state_dict(state)
    assert [first(next(resumed)) for _ in range(5)] == run[4:]

    grouped = BatchStream(samples, batch_size=5, seed=3, length_grouped=True)
    lengths = [sorted(len(samples[i // 100]["input_ids"]) for i in first(next(grouped))) for _ in range(2)]
    assert min(lengths[0]) >= max(lengths[1])  # longest samples batched together


def _samples(lengths: list[int]) -> list[dict]:
    return [{"input_ids": torch.arange(n) + 10 * i, "labels": torch.arange(n) + 10 * i} for i, n in enumerate(lengths)]


def test_packing_uses_every_sample_once_whole_with_its_own_positions():
    lengths = [5, 9, 3, 7, 2, 8, 6, 4, 1, 10] * 3
    samples = _samples(lengths)
    stream = BatchStream(samples, batch_size=2, seed=3, packing=True, max_seq_length=12)
    order = epoch_order(len(samples), 3, 0)
    seen = []
    while stream.epoch == 0:
        batch = stream.__next__()
        assert batch["input_ids"].shape[1] <= 12 and batch["input_ids"].shape[0] <= 2
        for r in range(batch["input_ids"].shape[0]):
            seg, ids = batch["segments"][r], batch["input_ids"][r]
            assert int(batch["lengths"][r]) == int((seg >= 0).sum())
            for j in range(int(seg.max()) + 1):
                part = ids[seg == j]
                first = int(part[0]) // 10
                assert torch.equal(part, samples[first]["input_ids"])  # a sample is whole and contiguous
                assert torch.equal(batch["positions"][r][seg == j], torch.arange(len(part)))
                seen.append(first)
    assert sorted(seen) == sorted(order) and len(seen) == len(order)  # every sample once


def test_packing_windows_are_first_fit_decreasing():
    """Each window holds the next samples of the order up to `window` batches' worth of tokens; longest first, each
    sample goes to the first row with room; rows come out in the order they were opened. Checked against the rule
    written out plainly, batch by batch over a whole epoch, and the rows end up far fuller than laying the samples
    into rows in their order would leave them."""
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 40, (300,), generator=g)]
    samples, capacity, n_rows, window = _samples(lengths), 64, 3, 4
    order = [int(i) for i in torch.randperm(300, generator=g)]
    position, batches, rows_seen = 0, 0, 0
    while position < len(order):
        rows, end = pack_window(samples, order, position, n_rows, capacity, window)
        budget, end_ref = window * n_rows * capacity, position
        while end_ref < len(order) and sum(lengths[i] for i in order[position:end_ref + 1]) <= budget:
            end_ref += 1
        ref, room = [], []
        for i in sorted(order[position:end_ref], key=lambda i: (-lengths[i], order.index(i))):
            fits = [r for r in range(len(ref)) if room[r] >= lengths[i]]
            if not fits:
                ref.append([])
                room.append(capacity)
                fits = [len(ref) - 1]
            ref[fits[0]].append(i)
            room[fits[0]] -= lengths[i]
        assert end == end_ref and [[int(s["input_ids"][0]) // 10 for s in row] for row in rows] == ref
        position, batches, rows_seen = end, batches + -(-len(rows) // n_rows), rows_seen + len(rows)
    assert sum(lengths) / (rows_seen * capacity) > 0.95  # laid in order, a row closing at its first misfit: 0.78


def test_count_of_packed_batches_is_what_the_stream_gives():
    """The epoch length finetune/lora.py plans with (steps per epoch, the learning-rate schedule) is the number of
    batches an unshuffled packed stream actually gives before its next epoch."""
    g = torch.Generator().manual_seed(1)
    samples = _samples([int(n) for n in torch.randint(1, 60, (500,), generator=g)])
    for n_rows, capacity in [(1, 64), (4, 64), (3, 200)]:
        stream = BatchStream(samples, batch_size=n_rows, shuffle=False, packing=True, max_seq_length=capacity)
        given = 0
        while stream.epoch == 0:
            next(stream)
            given += 1
        assert count_packed_batches(samples, n_rows, capacity) == given


def test_packed_stream_resumes_at_the_same_sample():
    samples = _samples([5, 9, 3, 7, 2, 8, 6, 4, 1, 10, 3, 3])
    a = BatchStream(samples, batch_size=1, seed=1, packing=True, max_seq_length=10)
    for _ in range(3):
        next(a)
    b = BatchStream(samples, batch_size=1, seed=99, packing=True, max_seq_length=10)
    b.load_state_dict(a.state_dict())
    for _ in range(8):  # into the next epoch
        x, y = next(a), next(b)
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_a_sample_longer_than_a_packed_row_is_refused_in_one_line():
    stream = BatchStream(_samples([4, 30, 5]), batch_size=2, seed=0, shuffle=False, packing=True, max_seq_length=16)
    with pytest.raises(UserError) as e:
        next(stream)
    assert "\n" not in str(e.value) and "30 tokens, more than --max_seq_length 16" in str(e.value)
