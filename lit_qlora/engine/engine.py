"""Many sequences generated at once: continuous batching over one model (vLLM's, SGLang's and llama.cpp's server's
way), with paged keys and values (`kv.KVPool`) and rows of different adapters in one forward (`adapters`).

Every `step` does two things. The decode: every running sequence feeds the token it was last given, all of them as
the rows of one forward [B, 1]; each row's next token is picked with that sequence's own settings and random
generator, and a sequence that stops (a stop id or string, its max_new_tokens, a cancel, its deadline) leaves at once,
giving its blocks back. The prefill: waiting sequences are admitted while their blocks fit in the budget (what does
not fit waits, never an out-of-memory failure), and up to `prefill_tokens` of their prompts are computed in one more
forward (chunked: a long prompt takes several steps, the running streams go on between them); a sequence whose
prompt is done gets its first token and decodes from the next step on. A prompt's leading blocks already in the
cache (the chat's next turn, the other completions of one prompt: those wait until the first one's prompt is in)
are not computed again.

Why a sequence's result does not depend on its neighbours: its tokens are picked from its own row's logits by its
own generator, and every op of a step computes each row on its own (the 4-bit kernel computes every row the same way
whatever the number of rows).
"""
from __future__ import annotations

import math
import queue
import secrets
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lit_qlora.engine.kv import KVPool, StepBatch
from lit_qlora.engine.text import TextStream
from lit_qlora.generation import sample
from lit_qlora.precision import autocast_for, parse_precision
from lit_qlora.quant.decode4bit import disable_fast_decode, enable_fast_decode
from lit_qlora.utils import UserError

DEFAULT_KV_GB = 1.0  # the KV budget when none is given (and no more than max_batch full contexts)


@dataclass(frozen=True)
class Sampling:
    """How one sequence is continued. temperature 0: greedy. A `seed` makes a sampled sequence repeatable (None: a
    random one). Generation stops at a stop id (kept as the last token, as `generation.generate` keeps eos), at a
    stop string (the text ends before it), or after `max_new_tokens`."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice i of a request (`n`, --num_samples) drawn with `seed`: the seed itself for the first, one
    made from it for each other (each choice draws with its own generator, whatever runs beside it)."""
    return seed if i == 0 else (seed + i * 0x9E3779B97F4A7C15) % 2**63


@dataclass
class Completion:
    """A finished sequence: its new ids, why it ended ("stop", "length", "cancelled", "timeout", "error"), its text
    (with a tokenizer), the prompt's length and how many of its tokens came from the prefix cache."""
    ids: list[int]
    finish_reason: str
    text: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Sequence:
    """One prompt being continued. `on_event(seq, kind, value)`, if given, hears ("token", id) for each new token,
    ("text", piece) as text is made (with a tokenizer) and ("end", finish_reason) once, from the thread that runs the
    engine."""

    def __init__(self, ids: list[int], sampling: Sampling, adapter: Optional[str], tokenizer, device: torch.device,
                 on_event: Optional[Callable] = None, deadline: Optional[float] = None) -> None:
        self.ids, self.prompt_len = list(ids), len(ids)
        self.sampling, self.adapter, self.on_event, self.deadline = sampling, adapter, on_event, deadline
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.stop_ids = set(sampling.stop_ids)
        self.text = TextStream(tokenizer, self.stop_ids, list(sampling.stop_strings)) if tokenizer else None
        self.table: list[int] = []  # its blocks in the pool
        self.computed = 0  # positions whose keys and values are in its blocks
        self.reserved = 0  # blocks it may still take
        self.cached = 0  # prompt positions found in the prefix cache
        self.finish_reason: Optional[str] = None
        self.cancelled = False  # set from any thread

    @property
    def new_ids(self) -> list[int]:
        return self.ids[self.prompt_len:]

    def result(self) -> Completion:
        return Completion(self.new_ids, self.finish_reason or "", self.text.sent if self.text else None,
                          self.prompt_len, self.cached)

    def emit(self, kind: str, value) -> None:
        if self.on_event is not None:
            self.on_event(self, kind, value)


class Engine:
    """Generation for many sequences at once over `model` (eval mode, used as it is: merged, with its own LoRA
    wrappers, or with several adapters in `bank`, an `adapters.AdapterBank` over it). `submit` from any thread;
    `step` (or `run`) from one.

    KV budget: `kv_cache_tokens` positions, or `kv_cache_gb` GiB (default `DEFAULT_KV_GB`, and no more than
    `max_batch` full contexts), in blocks of `block_size`. `max_batch`: sequences decoded together at most.
    `prefill_tokens`: prompt tokens (padding included) computed per step at most."""

    def __init__(self, model, tokenizer=None, bank=None, kv_cache_tokens: Optional[int] = None,
                 kv_cache_gb: Optional[float] = None, max_batch: int = 32, block_size: int = 16,
                 prefill_tokens: int = 256, precision: Optional[str] = None) -> None:
        self.model, self.tokenizer, self.bank = model, tokenizer, bank
        self.max_batch, self.prefill_tokens = max_batch, max(prefill_tokens, block_size)
        c = model.config
        ref = model.transformer.ln_f.weight
        self.device = ref.device
        self.autocast = autocast_for(precision, self.device) if precision else nullcontext()
        dtype = parse_precision(precision).dtype if precision else ref.dtype
        per_token = KVPool.bytes_per_token(c.n_layer, c.n_query_groups, c.head_size, dtype)
        if kv_cache_tokens is None:
            gb = DEFAULT_KV_GB if kv_cache_gb is None else kv_cache_gb
            kv_cache_tokens = int(gb * 2**30 // per_token)
            if kv_cache_gb is None:
                kv_cache_tokens = min(kv_cache_tokens, max_batch * c.block_size)
        blocks = kv_cache_tokens // block_size
        if blocks < 1:
            raise UserError(f"a KV cache budget of {kv_cache_tokens} tokens holds no block of {block_size}; raise "
                            "--kv_cache_gb")
        self.pool = KVPool(c.n_layer, c.n_query_groups, c.head_size, blocks, block_size, self.device, dtype)
        self.windows = [model.layer_window(i) for i in range(c.n_layer)]
        self.kv_bytes = (blocks * block_size + 1) * per_token
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: list[Sequence] = []
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.promised = 0  # blocks reserved by admitted sequences and not taken yet
        self.stats = dict(steps=0, decode_tokens=0, prefill_tokens=0, cached_tokens=0, finished=0, peak_batch=0)

    # ---- from any thread
    def submit(self, ids: list[int], sampling: Sampling, adapter: Optional[str] = None,
               on_event: Optional[Callable] = None, deadline: Optional[float] = None) -> Sequence:
        """Queue a prompt (a one-line UserError if it can never run: too long for the model or the KV budget, an
        unknown adapter); it starts at a later `step`."""
        self.check(len(ids), sampling, adapter)
        seq = Sequence(ids, sampling, adapter, self.tokenizer, self.device, on_event, deadline)
        self.inbox.put(seq)
        return seq

    def check(self, prompt_tokens: int, sampling: Sampling, adapter: Optional[str] = None) -> None:
        limit = self.model.config.block_size
        if prompt_tokens < 1:
            raise UserError("an empty prompt has nothing to continue; give it at least one token")
        if sampling.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1, got {sampling.max_new_tokens}")
        if prompt_tokens + sampling.max_new_tokens > limit:
            raise UserError(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens={sampling.max_new_tokens} "
                            f"exceed the model's context of {limit} tokens; shorten the prompt or lower "
                            "max_new_tokens")
        need = self._blocks_for(prompt_tokens + sampling.max_new_tokens)
        if need > self.pool.blocks:
            raise UserError(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens={sampling.max_new_tokens} need "
                            f"{need * self.pool.block_size} tokens of KV cache, the budget holds "
                            f"{self.pool.blocks * self.pool.block_size}; raise --kv_cache_gb or lower max_new_tokens")
        if adapter is not None and (self.bank is None or adapter not in self.bank.adapters):
            known = ", ".join(self.bank.adapters) if self.bank is not None else "none"
            raise UserError(f"unknown adapter {adapter!r}; this engine has: {known}")

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True

    def abort(self) -> None:
        """End every sequence ("error"), its blocks given back: after a step failed half way."""
        while not self.inbox.empty():
            self.waiting.append(self.inbox.get())
        for group in (self.waiting, self.prefilling, self.running):
            for seq in list(group):
                self._finish(seq, "error", group)

    # ---- from the thread that runs the engine
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or not self.inbox.empty())

    def run(self) -> None:
        """Step until every submitted sequence has finished."""
        while self.busy:
            self.step()

    @torch.inference_mode()
    def step(self) -> None:
        while not self.inbox.empty():
            self.waiting.append(self.inbox.get())
        self._drop_stopped()
        if self.running:
            self._decode()
        self._admit()
        if self.prefilling:
            self._prefill()
        self.stats["steps"] += 1

    def _blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.pool.block_size)

    def _drop_stopped(self) -> None:
        now = time.monotonic()
        for group in (self.waiting, self.prefilling, self.running):
            for seq in list(group):
                if seq.cancelled or (seq.deadline is not None and now > seq.deadline):
                    self._finish(seq, "cancelled" if seq.cancelled else "timeout", group)

    def _admit(self) -> None:
        """Waiting sequences in order, while their blocks fit (those whose prompt another admitted sequence is still
        computing wait for it, then take its blocks from the cache)."""
        busy_prompts = {(s.adapter, tuple(s.ids)) for s in self.prefilling}
        for seq in list(self.waiting):
            if len(self.running) + len(self.prefilling) >= self.max_batch:
                return
            if (seq.adapter, tuple(seq.ids)) in busy_prompts:
                continue
            hits = self.pool.lookup(seq.adapter, seq.ids, seq.prompt_len - 1)
            need = self._blocks_for(seq.prompt_len + seq.sampling.max_new_tokens) - len(hits)
            if need > self.pool.available() - self.promised:
                self.pool.give_back(hits)
                return
            seq.table, seq.reserved = hits, need
            seq.computed = seq.cached = len(hits) * self.pool.block_size
            self.promised += need
            self.stats["cached_tokens"] += seq.cached
            self.waiting.remove(seq)
            self.prefilling.append(seq)
            busy_prompts.add((seq.adapter, tuple(seq.ids)))

    def _grow(self, seq: Sequence, end: int) -> None:
        """Blocks for positions up to `end` (taken from its reservation)."""
        while len(seq.table) * self.pool.block_size < end:
            seq.table.append(self.pool.take())
            seq.reserved -= 1
            self.promised -= 1

    def _prefill(self) -> None:
        """Up to `prefill_tokens` prompt tokens of the sequences being admitted, as rows of one forward."""
        rows: list[Sequence] = []
        chunk = 0  # tokens per row: rows are padded to the longest piece
        for seq in self.prefilling:
            longest = max(chunk, min(seq.prompt_len - seq.computed, self.prefill_tokens))
            if rows and (len(rows) + 1) * longest > self.prefill_tokens:
                break
            rows.append(seq)
            chunk = longest
        pieces = [s.ids[s.computed:min(s.prompt_len, s.computed + chunk)] for s in rows]
        done = [s.computed + len(p) == s.prompt_len for s, p in zip(rows, pieces)]
        logits = self._forward(rows, pieces, done)
        self.stats["prefill_tokens"] += sum(len(p) for p in pieces)
        finished = [s for s, d in zip(rows, done) if d]
        for seq, piece in zip(rows, pieces):
            seq.computed += len(piece)
        rows, picks = [], []
        for i, seq in enumerate(finished):
            self.pool.publish(seq.adapter, seq.ids, seq.table, seq.prompt_len)
            self.prefilling.remove(seq)
            for s in [seq, *self._fork(seq)]:
                self.running.append(s)
                rows.append(s)
                picks.append(i)
        if rows:
            self._take_tokens(rows, logits[picks])

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The waiting sequences with `seq`'s very prompt and adapter (a request's other choices) that fit now, started
        from its keys and values: its full blocks shared, its last partial block copied, their first token drawn from
        its logits. The prompt is computed once for all of them."""
        twins = [s for s in self.waiting if s.adapter == seq.adapter and s.ids == seq.ids]
        bs, out = self.pool.block_size, []
        full, partial = divmod(seq.prompt_len, bs)
        for twin in twins:
            if len(self.running) + len(self.prefilling) >= self.max_batch:
                break
            need = self._blocks_for(twin.prompt_len + twin.sampling.max_new_tokens) - full
            if need > self.pool.available() - self.promised:
                break
            for block in seq.table[:full]:
                self.pool.hold(block)
            twin.table, twin.reserved = seq.table[:full], need
            self.promised += need
            twin.computed = twin.prompt_len
            twin.cached = seq.cached
            if partial:
                self._grow(twin, twin.prompt_len)
                self.pool.copy_slots(seq.table[full] * bs, twin.table[full] * bs, partial)
            self.waiting.remove(twin)
            out.append(twin)
        return out

    def _decode(self) -> None:
        rows = list(self.running)
        logits = self._forward(rows, [[s.ids[-1]] for s in rows], [True] * len(rows))
        for seq in rows:
            seq.computed += 1
        self.stats["decode_tokens"] += len(rows)
        self.stats["peak_batch"] = max(self.stats["peak_batch"], len(rows))
        self._take_tokens(rows, logits)

    def _forward(self, rows: list[Sequence], pieces: list[list[int]], want: list[bool]) -> torch.Tensor:
        """Logits [sum(want), V] of the last token of each row that wants them, the rows' new tokens fed at their
        positions (its cached ones before them). Rows of one adapter go together; an adapter that cannot share a
        forward (`AdapterBank.mixable`) gets one of its own."""
        groups: dict = {}  # None: the rows that share one forward; an adapter's name: its rows alone
        for i in sorted(range(len(rows)), key=lambda i: (rows[i].adapter is not None, rows[i].adapter or "")):
            groups.setdefault(rows[i].adapter if self._alone(rows[i]) else None, []).append(i)
        out: list[Optional[torch.Tensor]] = [None] * len(rows)
        for group in groups.values():
            logits = iter(self._forward_group([rows[i] for i in group], [pieces[i] for i in group],
                                              [want[i] for i in group]))
            for i in group:
                if want[i]:
                    out[i] = next(logits)
        return torch.stack([o for o in out if o is not None]) if any(want) else torch.empty(0)

    def _alone(self, seq: Sequence) -> bool:
        return self.bank is not None and not self.bank.mixable(seq.adapter)

    def _forward_group(self, rows: list[Sequence], pieces: list[list[int]], want: list[bool]) -> torch.Tensor:
        B, T = len(rows), max(len(p) for p in pieces)
        idx = torch.zeros(B, T, dtype=torch.long)
        positions = torch.zeros(B, T, dtype=torch.long)
        real = torch.zeros(B, T, dtype=torch.bool)
        output = torch.zeros(B, T, dtype=torch.bool)
        for b, (seq, piece) in enumerate(zip(rows, pieces)):
            n = len(piece)
            self._grow(seq, seq.computed + n)
            idx[b, :n] = torch.tensor(piece)
            positions[b] = torch.arange(seq.computed, seq.computed + T).clamp_max(seq.computed + n - 1)
            real[b, :n] = True
            output[b, n - 1] = want[b]
        ends = [s.computed + len(p) for s, p in zip(rows, pieces)]
        batch = StepBatch(self.pool, positions.to(self.device), real.to(self.device), [s.table for s in rows], ends,
                          [max(end, s.prompt_len) for s, end in zip(rows, ends)], self.windows)
        if self.bank is not None:
            if self._alone(rows[0]):
                self.bank.activate(rows[0].adapter)
            else:
                self.bank.route([s.adapter for s in rows], T, want)
        with self.autocast:
            return self.model(idx.to(self.device), batch=batch, output_mask=output.to(self.device))

    def _take_tokens(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """Each row's next token from its logits [len(rows), V], then what follows from it (text, a stop)."""
        greedy = [i for i, s in enumerate(rows) if s.sampling.temperature <= 0]
        tokens: list[int] = [0] * len(rows)
        if greedy:  # in fp32, as generation.sample: the same index, one op for all of them
            for i, t in zip(greedy, logits[greedy].float().argmax(-1).tolist()):
                tokens[i] = t
        for i, seq in enumerate(rows):
            s = seq.sampling
            if s.temperature > 0:
                tokens[i] = int(sample(logits[i], s.temperature, s.top_k, s.top_p, seq.generator))
        for seq, token in zip(rows, tokens):
            seq.ids.append(token)
            seq.emit("token", token)
            reason = None
            if seq.text is not None:
                piece, stopped = seq.text.feed(token)
                if piece:
                    seq.emit("text", piece)
                reason = "stop" if stopped else None
            if token in seq.stop_ids:
                reason = "stop"
            elif reason is None and len(seq.ids) - seq.prompt_len >= seq.sampling.max_new_tokens:
                reason = "length"
            if reason is not None:
                self._finish(seq, reason, self.running, text_stopped=reason == "stop" and token not in seq.stop_ids)

    def _finish(self, seq: Sequence, reason: str, group: list, text_stopped: bool = False) -> None:
        """`seq` leaves: its blocks given back (the full ones kept in the prefix cache), its reservation freed."""
        group.remove(seq)
        if seq.table:
            self.pool.publish(seq.adapter, seq.ids, seq.table, seq.computed)
            self.pool.give_back(seq.table)
            seq.table = []
        self.promised -= seq.reserved
        seq.reserved = 0
        seq.finish_reason = reason
        if seq.text is not None and not text_stopped and reason in ("stop", "length"):
            tail = seq.text.finish()
            if tail:
                seq.emit("text", tail)
        self.stats["finished"] += 1
        seq.emit("end", reason)


@contextmanager
def decoding(model):
    """`model` ready for the engine for the duration: eval mode (no dropout), and its 4-bit layers on CPU decoding
    through the 4-bit kernel with an unmerged LoRA's update inside the same call (`decode4bit.enable_fast_decode`:
    class swaps over the same weights, no copy); afterwards the layers it converted and the mode are as they were. A
    model being trained (GRPO's policy) is sampled this way between its optimizer steps."""
    was_training = model.training
    if was_training:  # (a caller may have set its own eval mode: quantize.validation_mode keeps int8 layers training)
        model.eval()
    converted = enable_fast_decode(model)  # 0 where a generation script's loader converted them already
    try:
        yield model
    finally:
        if converted:
            disable_fast_decode(model)
        model.train(was_training)


def generate_batch(model, prompts: list[list[int]], sampling: Sampling | list[Sampling], *, tokenizer=None,
                   bank=None, adapters: Optional[list[Optional[str]]] = None, kv_cache_tokens: Optional[int] = None,
                   max_batch: Optional[int] = None, precision: Optional[str] = None) -> list[Completion]:
    """Continue every prompt (lists of ids) with its `sampling` (one for all, or one each), as one continuous batch,
    by `model` as it is (`decoding`: eval mode, 4-bit layers on the kernel, for the call); the completions in the
    prompts' order. The KV budget defaults to what all of them need at once."""
    settings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if len(settings) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(settings)} sampling settings")
    if not prompts:
        return []
    block = 16
    need = sum(math.ceil((len(p) + s.max_new_tokens) / block) * block for p, s in zip(prompts, settings))
    engine = Engine(model, tokenizer=tokenizer, bank=bank, kv_cache_tokens=min(need, kv_cache_tokens or need),
                    max_batch=max_batch or len(prompts), block_size=block, precision=precision)
    seqs = [engine.submit(p, s, a) for p, s, a in zip(prompts, settings, adapters or [None] * len(prompts))]
    with decoding(model):
        engine.run()
    return [s.result() for s in seqs]
