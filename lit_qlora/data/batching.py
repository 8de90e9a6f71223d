"""Batches for training: right-padded collation, packed rows of several samples, and a reproducible, resumable
stream of batches, epoch after epoch."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from lit_qlora.utils import UserError


def collate(
    samples: list[dict[str, Tensor]], pad_id: int = 0, ignore_index: int = -100, pad_multiple_of: int | None = None
) -> dict[str, Tensor]:
    """Right-pad to the longest sample (rounded up to pad_multiple_of). Padded labels get
    ignore_index, so padding never counts in the loss whatever pad_id is."""
    T = max(len(s["input_ids"]) for s in samples)
    if pad_multiple_of:
        T = -(-T // pad_multiple_of) * pad_multiple_of
    input_ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), T), ignore_index, dtype=torch.long)
    lengths = torch.zeros(len(samples), dtype=torch.long)  # real (non-pad) tokens per row
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[i, :n] = s["input_ids"]
        labels[i, :n] = s["labels"]
        lengths[i] = n
    return {"input_ids": input_ids, "labels": labels, "lengths": lengths}


def collate_packed(rows: list[list[dict[str, Tensor]]], pad_id: int = 0, ignore_index: int = -100) -> dict[str, Tensor]:
    """Rows of samples laid end to end, right-padded to the longest row. Besides input_ids, labels and lengths (real
    tokens per row): `positions`, restarting at 0 with every sample, and `segments`, the sample's number in its row
    (-1 for padding), which keep attention inside each sample (GPT.forward). Each sample's first label is ignored: the
    token before it belongs to another sample, so every sample is trained exactly as it would be alone."""
    L = max(sum(len(s["input_ids"]) for s in row) for row in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), L), ignore_index, dtype=torch.long)
    positions = torch.zeros((len(rows), L), dtype=torch.long)
    segments = torch.full((len(rows), L), -1, dtype=torch.long)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for j, s in enumerate(row):
            n = len(s["input_ids"])
            input_ids[r, at:at + n] = s["input_ids"]
            labels[r, at:at + n] = s["labels"]
            labels[r, at] = ignore_index
            positions[r, at:at + n] = torch.arange(n)
            segments[r, at:at + n] = j
            at += n
        lengths[r] = at
    return {"input_ids": input_ids, "labels": labels, "lengths": lengths, "positions": positions, "segments": segments}


def unpad(batch: dict[str, Tensor], targets: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """The same samples without their padding: one row holding each row's real tokens (its `lengths`) end to end,
    with `positions` and `segments` that keep every sample's attention and positions as they were (GPT.forward), and
    the targets to match. The samples' losses and gradients are those of the padded batch; only the padding's
    computation is gone. Packed rows (with `segments`) keep their samples apart the same way."""
    rows, width = batch["input_ids"].shape
    lengths = batch["lengths"].tolist()
    if rows == 1 and lengths[0] == width:  # nothing to drop
        return batch, targets
    keep = torch.arange(width)[None, :] < batch["lengths"][:, None]  # [B, T], real tokens
    positions = batch.get("positions", torch.arange(width).expand(rows, width))
    # sample numbers unique across rows, so two rows' samples never meet
    segments = batch.get("segments", torch.zeros(rows, width, dtype=torch.long)) + torch.arange(rows)[:, None] * width
    out = {k: t[keep][None] for k, t in (("input_ids", batch["input_ids"]), ("labels", batch["labels"]),
                                         ("positions", positions), ("segments", segments))}
    out["lengths"] = torch.tensor([sum(lengths)])
    return out, targets[keep][None]


PACKING_WINDOW = 16  # batches' worth of samples packed together (first fit decreasing)


def pack_window(samples: list[dict[str, Tensor]], order: list[int], start: int, n_rows: int, capacity: int,
                window: int = PACKING_WINDOW) -> tuple[list[list[dict[str, Tensor]]], int]:
    """Rows of at most `capacity` tokens for the samples of `order` from `start` on, as many as `window` batches of
    `n_rows` rows hold (at least one sample): longest sample first, each into the first row with room (first fit
    decreasing). Rows come out in the order they were opened; a sample's tokens stay contiguous. Laying samples
    into rows in their order instead (a row closes at the first sample it has no room for) left 15-20% of the rows
    empty on Alpaca-like data; packed this way, a few percent (tutorials/performance.md). Returns (rows, the
    position after the window)."""
    end, tokens = start, 0
    while end < len(order):
        n = len(samples[order[end]]["input_ids"])
        if n > capacity:
            raise UserError(f"sample {order[end]} has {n} tokens, more than --max_seq_length {capacity}, so it cannot "
                            "be packed; prepare the data with this --max_seq_length or raise --max_seq_length")
        if end > start and tokens + n > window * n_rows * capacity:
            break
        tokens += n
        end += 1
    rows: list[list[dict[str, Tensor]]] = []
    room: list[int] = []
    for i in sorted(order[start:end], key=lambda i: -len(samples[i]["input_ids"])):  # stable: ties keep the order
        n = len(samples[i]["input_ids"])
        r = next((r for r in range(len(rows)) if room[r] >= n), None)
        if r is None:
            rows.append([])
            room.append(capacity)
            r = len(rows) - 1
        rows[r].append(samples[i])
        room[r] -= n
    return rows, end


def count_packed_batches(samples: list[dict[str, Tensor]], n_rows: int, capacity: int) -> int:
    """How many batches of `n_rows` packed rows one epoch makes (in the samples' own order; a shuffled epoch may
    differ by a batch or so): for a run given in epochs and its learning-rate schedule."""
    order, position, batches = list(range(len(samples))), 0, 0
    while position < len(order):
        rows, position = pack_window(samples, order, position, n_rows, capacity)
        batches += -(-len(rows) // n_rows)
    return batches


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Sample order of one epoch, rebuilt from (seed, epoch) alone so a resumed run needs no saved generator state.
    The first epoch's order is the one `DataLoader(shuffle=True, generator=Generator().manual_seed(seed))` gives,
    so a run sees its samples in the same order as tools built on that (e.g. LitGPT, the HF recipe)."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed)
    for e in range(epoch + 1):
        # Each epoch the DataLoader's iterator draws its base seed from the generator, then the sampler permutes
        torch.empty((), dtype=torch.int64).random_(generator=g)
        order = torch.randperm(n, generator=g)
    return order.tolist()


class BatchStream:
    """Endless stream of collated batches, epoch after epoch, reproducible from `seed` and resumable
    from `state_dict()` (epoch, position, row, seed). The last batch of an epoch may be smaller.

    length_grouped: within chunks of 64 batches of the shuffled order, sort samples by length so a
    batch holds similar lengths (less padding); batches stay in an order fixed by the seed.
    packing (with max_seq_length): a batch is `batch_size` rows of up to max_seq_length tokens holding whole samples
    (`collate_packed`), packed a window of batches at a time (`pack_window`; the window's last batch may be
    smaller). The position counts samples up to the current window, `row` the rows of it already given out.
    """

    def __init__(
        self,
        samples: list[dict[str, Tensor]],
        batch_size: int,
        seed: int = 42,
        shuffle: bool = True,
        length_grouped: bool = False,
        pad_id: int = 0,
        ignore_index: int = -100,
        pad_multiple_of: int | None = None,
        packing: bool = False,
        max_seq_length: int | None = None,
    ) -> None:
        if not samples:
            raise UserError("no samples to train on; check the data folder")
        if packing and not max_seq_length:
            raise ValueError("packing needs max_seq_length, the length of a packed row")
        self.packing, self.max_seq_length = packing, max_seq_length
        self.samples, self.batch_size, self.seed = samples, batch_size, seed
        self.shuffle, self.length_grouped = shuffle, length_grouped
        self.collate_kw = dict(pad_id=pad_id, ignore_index=ignore_index, pad_multiple_of=pad_multiple_of)
        self.epoch, self.position, self.row = 0, 0, 0
        self._order: list[int] | None = None
        self._window: tuple[int, list, int] | None = None  # (position, its rows, the position after them)

    def _epoch_order(self) -> list[int]:
        order = epoch_order(len(self.samples), self.seed, self.epoch, self.shuffle)
        if self.length_grouped:
            chunk = self.batch_size * 64
            order = [i for c in range(0, len(order), chunk)
                     for i in sorted(order[c:c + chunk], key=lambda j: -len(self.samples[j]["input_ids"]))]
        return order

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return self

    def __next__(self) -> dict[str, Tensor]:
        if self._order is None:
            self._order = self._epoch_order()
        if self.packing:
            if self._window is None or self._window[0] != self.position:
                self._window = (self.position, *pack_window(self.samples, self._order, self.position,
                                                            self.batch_size, self.max_seq_length))
            _, rows, end = self._window
            batch = collate_packed(rows[self.row:self.row + self.batch_size], self.collate_kw["pad_id"],
                                   self.collate_kw["ignore_index"])
            self.row += self.batch_size
            if self.row >= len(rows):
                self.position, self.row = end, 0
        else:
            idx = self._order[self.position:self.position + self.batch_size]
            self.position += len(idx)
            batch = self.collate_batch([self.samples[i] for i in idx])
        if self.position >= len(self._order):
            self.epoch, self.position, self._order, self._window = self.epoch + 1, 0, None, None
        return batch

    def collate_batch(self, samples: list) -> dict[str, Tensor]:
        """One batch of samples (not packed); a subclass streams other kinds of samples (lit_qlora.train.preference)."""
        return collate(samples, **self.collate_kw)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "row": self.row, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # The saved seed wins over the current one: resuming must replay the same order.
        self.seed = int(state.get("seed", self.seed))
        self.epoch, self.position, self.row = int(state["epoch"]), int(state["position"]), int(state.get("row", 0))
        self._order = self._window = None
