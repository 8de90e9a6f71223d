"""Collation and the reproducible, resumable batch stream."""
from __future__ import annotations

import torch

from lit_qlora.batching import BatchStream, collate


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
    assert state == {"epoch": 1, "position": 4, "seed": 3}
    resumed = BatchStream(samples, batch_size=4, seed=99)
    resumed.load_state_dict(state)
    assert [first(next(resumed)) for _ in range(5)] == run[4:]

    grouped = BatchStream(samples, batch_size=5, seed=3, length_grouped=True)
    lengths = [sorted(len(samples[i // 100]["input_ids"]) for i in first(next(grouped))) for _ in range(2)]
    assert min(lengths[0]) >= max(lengths[1])  # longest samples batched together
