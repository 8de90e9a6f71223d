"""The keys and values of every running sequence in one bounded pool of fixed-size blocks (paged, as vLLM's), and the
batch a step of the engine hands to `GPT.forward`.

Why blocks: sequences of different lengths share one budget without each reserving the longest one's length, a
finished sequence gives its blocks back at once, and a prompt prefix already computed (the chat's next turn, the
other completions of one prompt) is shared block by block instead of computed again (`KVPool.lookup`).

Position p of a sequence lives in slot `table[p // block_size] * block_size + p % block_size` of each layer's
[slots, G, hs] tensors (`table`: its blocks); one more slot at the end takes what padding positions write. Every
slot starts at zero and only ever holds finite keys and values, so what a row does not see (masked) can never turn
into NaN.
"""
from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from lit_qlora.quant.decode4bit import decode_attention, kernel


@dataclass
class _Cached:
    """A full block of the prefix cache: its block, the key of the block before it and its tokens (compared on every
    hit: a hash alone could collide)."""
    block: int
    parent: Optional[int]
    tokens: tuple


class KVPool:
    """`blocks` blocks of `block_size` positions for every layer, allocated once (zeros, the memory
    taken as blocks are first written). Blocks are taken by
    sequences (`take`), given back (`give_back`), and the full blocks of a prompt are kept, keyed by the adapter and
    every token up to their end, for the next sequence that starts with the same ids (`publish`, `lookup`): a kept
    block nobody uses any more stays until its room is needed (least recently used first)."""

    def __init__(self, n_layer: int, n_groups: int, head_size: int, blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.block_size, self.blocks = block_size, blocks
        self.scratch = blocks * block_size  # the slot padding writes to
        shape = (blocks * block_size + 1, n_groups, head_size)
        self.k = [zeros(shape, device, dtype) for _ in range(n_layer)]
        self.v = [zeros(shape, device, dtype) for _ in range(n_layer)]
        self.refs = [0] * blocks
        self.free = list(range(blocks - 1, -1, -1))  # never used or evicted: taken from the end
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.cache: dict[int, _Cached] = {}  # key -> cached block
        self.key_of: dict[int, int] = {}  # cached block -> its key

    @staticmethod
    def bytes_per_token(n_layer: int, n_groups: int, head_size: int, dtype: torch.dtype) -> int:
        return 2 * n_layer * n_groups * head_size * torch.empty(0, dtype=dtype).element_size()

    def available(self) -> int:
        """Blocks that can be taken now (free, or cached and idle)."""
        return len(self.free) + len(self.idle)

    def take(self) -> int:
        """One block for a sequence to write: a free one, else the idle cached block used longest ago."""
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.idle.popitem(last=False)
            del self.cache[self.key_of.pop(block)]
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        if self.refs[block] == 0:
            self.idle.pop(block, None)
        self.refs[block] += 1

    def give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)

    @staticmethod
    def key(parent: Optional[int], adapter: Optional[str], tokens: tuple) -> int:
        return hash((parent, adapter, tokens))

    def lookup(self, adapter: Optional[str], ids: list[int], limit: int) -> list[int]:
        """The cached blocks that hold the first positions of `ids` under `adapter`, at most `limit` positions' worth
        (whole blocks only), each held for the caller."""
        bs, found, parent = self.block_size, [], None
        for j in range(limit // bs):
            tokens = tuple(ids[j * bs:(j + 1) * bs])
            key = self.key(parent, adapter, tokens)
            hit = self.cache.get(key)
            if hit is None or hit.parent != parent or hit.tokens != tokens:
                break
            self.hold(hit.block)
            found.append(hit.block)
            parent = key
        return found

    def publish(self, adapter: Optional[str], ids: list[int], table: list[int], upto: int) -> None:
        """Offer the full blocks of `table` that hold positions below `upto` of `ids` to later sequences."""
        bs, parent = self.block_size, None
        for j in range(upto // bs):
            tokens = tuple(ids[j * bs:(j + 1) * bs])
            key = self.key(parent, adapter, tokens)
            block = table[j]
            if key not in self.cache and block not in self.key_of:
                self.cache[key] = _Cached(block, parent, tokens)
                self.key_of[block] = key
            parent = key

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy n slots' keys and values of every layer from slot src on to slot dst on."""
        for k, v in zip(self.k, self.v):
            k[dst:dst + n] = k[src:src + n]
            v[dst:dst + n] = v[src:src + n]


def zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros; on CPU in pages the OS maps only once they are written (an anonymous mapping), so a budget
    of several GB costs the memory of the blocks used so far, not all of it at start."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


class PagedLayer:
    """What one layer's attention reads and writes in one step (`GPT.forward(batch=...)`): the new keys and values
    go to their slots, and every row's keys and values come back as [B, G, L, hs] in position order (`update`); or,
    for a decoding step, the attention itself, read straight from the pool by the decode kernel (`decode`)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, write: torch.Tensor, read: torch.Tensor,
                 span: Optional[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.k, self.v, self.write, self.read, self.span = k, v, write, read, span

    def decode(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[torch.Tensor]:
        """The attention output [B, H, 1, hs] of one new query per row (`decode4bit.decode_attention`), after
        writing its key and value; None (nothing written) where the kernel cannot take it (then `update`)."""
        c = attn.config
        if (self.span is None or torch.is_grad_enabled() or q.dtype != self.k.dtype or k.dtype != self.k.dtype
                or kernel() is None):
            return None
        B, G, T, hs = k.shape
        self.k.index_copy_(0, self.write, k.transpose(1, 2).reshape(B * T, G, hs))
        self.v.index_copy_(0, self.write, v.transpose(1, 2).reshape(B * T, G, hs))
        sinks = attn.sinks if c.attn_sinks else None
        return decode_attention(q, self.k, self.v, self.read, *self.span, c.attention_scale or hs**-0.5,
                                c.attn_softcap, sinks)

    def update(self, input_pos, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, G, T, hs = k.shape
        self.k.index_copy_(0, self.write, k.transpose(1, 2).reshape(B * T, G, hs).to(self.k.dtype))
        self.v.index_copy_(0, self.write, v.transpose(1, 2).reshape(B * T, G, hs).to(self.v.dtype))
        L = self.read.size(1)
        keys = self.k.index_select(0, self.read.view(-1)).view(B, L, G, hs).transpose(1, 2)
        values = self.v.index_select(0, self.read.view(-1)).view(B, L, G, hs).transpose(1, 2)
        return keys.to(k.dtype), values.to(v.dtype)


class StepBatch:
    """One forward of the engine: B rows of T token slots each (a row's real tokens first, then padding), row b
    holding positions positions[b] of its sequence, whose cached keys and values (after this step's are written)
    are its first lengths[b] positions. What `GPT.forward(batch=...)` reads. `rope_lengths[b]`: the length row b's
    sequence reaches in the call that would compute these positions alone (a prompt's whole length in each of its
    chunks, then one more per token), by which longrope picks its factors (`GPT.rope_cache`)."""

    def __init__(self, pool: KVPool, positions: torch.Tensor, real: torch.Tensor, tables: list[list[int]],
                 lengths: list[int], rope_lengths: list[int], windows: Optional[list[Optional[int]]] = None) -> None:
        device = positions.device
        B, T = positions.shape
        self.positions, self.real, self.lengths, self.rope_lengths = positions, real, lengths, rope_lengths
        self.kv_len = L = max(lengths)
        # the slot of every position, from the rows' block tables (padded with the scratch block, whose slots only
        # padding writes to): tensor ops, not a Python loop over B x L positions
        bs = pool.block_size
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [pool.blocks] * (width - len(t)) for t in tables], dtype=torch.long)
        keys = torch.arange(L)
        read = table[:, keys // bs] * bs + keys % bs  # [B, L]
        self.read = torch.where(keys[None] < torch.tensor(lengths)[:, None], read, pool.scratch).to(device)
        pos = positions.cpu()
        write = table.gather(1, pos // bs) * bs + pos % bs  # [B, T]
        self.write = torch.where(real.cpu(), write, pool.scratch).view(-1).to(device)
        spans = {}  # window -> (first, end) position each row attends to, for a decoding step (T = 1)
        if T == 1 and windows is not None:
            ends = torch.tensor(lengths, dtype=torch.long)
            for w in set(windows):
                spans[w] = ((ends - w).clamp_min(0) if w is not None else torch.zeros_like(ends), ends)
        windows = windows or [None] * len(pool.k)
        self.caches = [PagedLayer(k, v, self.write, self.read, spans.get(w))
                       for k, v, w in zip(pool.k, pool.v, windows)]
        self._masks: dict = {}

    def mask(self, window: Optional[int]) -> torch.Tensor:
        """[B, 1, T, L]: a token sees its own sequence's keys up to its position (the last `window` of them); a
        padding slot sees its row's first key only (its output is never used; a row of nothing would be NaN)."""
        if window not in self._masks:
            keys = torch.arange(self.kv_len, device=self.positions.device)
            pos = self.positions[:, :, None]
            seen = keys[None, None, :] <= pos
            if window is not None:
                seen &= keys[None, None, :] > pos - window
            seen &= keys[None, None, :] < torch.tensor(self.lengths, device=pos.device)[:, None, None]
            seen = torch.where(self.real[:, :, None], seen, keys[None, None, :] == 0)
            self._masks[window] = seen.unsqueeze(1)
        return self._masks[window]
