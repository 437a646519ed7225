"""Continuous batching: which sequences the next forward runs, admitted while KV blocks allow.

A Sequence is one token stream being sampled (a trajectory, turn after turn). Its state:

    waiting  -- has tokens not yet in the KV cache (a prompt, an observation after a turn, or all
                of it after an eviction); queued for a prefill forward
    running  -- in the decode batch: one token per step
    paused   -- its turn ended; keeps its blocks until the caller continues it (add) or ends it
    (done)   -- blocks released

Each call to schedule() returns the next forward: a prefill of queued sequences (as many as the
free blocks and the token budget of one forward allow; only the first may be cut into chunks),
or else one decode step of every running sequence. New prompts are admitted whenever free blocks
allow (no waves, no worst-case reservation). When a decode step needs a block and none is free,
the most recently admitted sequence is evicted: its blocks are freed and it is queued to be
recomputed from its ids (tokens and randomness are per position, so nothing changes).

Identical new prompts (the G samples of a prompt) form one group while they wait, whichever
add() call queued them: a new prompt joins the queued group with the same ids (equal ids, not
just equal length). The group's first sequence is prefilled, the others share its blocks and its
last logits (block_manager.py copies the partly filled last block on first write). A prompt
that arrives after its group was prefilled starts a new group (no prefix cache).

Tests: .venv/bin/pytest tests/test_engine.py
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager


@dataclass(eq=False)
class Sequence:
    ids: list[int]  # prompt + every turn so far (sampled, observation and template tokens)
    key: int  # counter-based sampling key (sampling.row_key)
    index: int = 0  # the caller's id for it (trajectory index)
    loss_mask: list[int] = field(default_factory=list)  # aligned to ids: 1 on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # aligned to ids: 0.0 where mask is 0
    versions: list[int] = field(default_factory=list)  # aligned to ids: the weights' version (Engine.version)
    #                                                    that sampled each token, 0 where nothing was sampled
    turn_start: int = 0  # where the current turn's sampled tokens begin in ids
    num_turns: int = 0
    budget: int = 0  # tokens this turn may sample (max_new_tokens, or less near max_context)
    stop_reason: str = ""  # why the last turn ended: stop | eos | length | max_context
    status: str = "new"  # new | waiting | running | paused | done
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens of ids whose K/V are in the cache
    followers: list["Sequence"] = field(default_factory=list)  # same prompt: sampled from our prefill
    epoch: int = 0  # times it joined the decode batch (a row that left and came back is a new row)

    def __post_init__(self):
        n = len(self.ids)
        self.loss_mask = self.loss_mask or [0] * n
        self.logprobs = self.logprobs or [0.0] * n
        self.versions = self.versions or [0] * n

    def extend(self, ids: list[int], *, loss: bool = False) -> None:
        """Append tokens this engine did not sample: an observation (loss mask 0), or with loss=True a
        scripted turn the loss trains on (loss mask 1; logprob and version 0: no sampler saw it)."""
        self.ids.extend(ids)
        self.loss_mask.extend([int(loss)] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([0] * len(ids))


@dataclass
class Batch:
    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]
    chunks: list[int] = field(default_factory=list)  # prefill: tokens fed per sequence
    steps: int = 1  # decode: steps whose blocks are reserved


class Scheduler:
    def __init__(self, blocks: BlockManager, max_rows: int = 0, prefill_tokens: int = 16384, rows_in_place: bool = False):
        """rows_in_place: a row leaving the decode batch is replaced by the last one (one row moves
        on the device instead of every row after it); False keeps the order rows joined in."""
        self.blocks = blocks
        self.rows_in_place = rows_in_place
        self.max_rows = max_rows  # most sequences decoding at once (0: as many as blocks allow)
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (rows x longest)
        self.returning: deque[list[Sequence]] = deque()  # evicted or continuing: go first
        self.new: deque[list[Sequence]] = deque()  # new prompts, grouped by identical ids
        self.new_groups: dict[tuple, list[Sequence]] = {}  # ids -> its group in self.new (not yet prefilled)
        self.running: list[Sequence] = []
        self.holders: dict[Sequence, None] = {}  # every sequence holding blocks, oldest first
        self.evictions = 0
        self.prefilled_tokens = 0  # tokens fed to prefill forwards (prompts, observations, recomputes)
        self.prefilled_prompt_tokens = 0  # of them, new prompts' (once per group of identical prompts)

    def busy(self) -> bool:
        return bool(self.running or self.returning or self.new)

    # -------------------------------------------------------------------------
    # state changes requested by the engine

    def add(self, seqs: list[Sequence]) -> None:
        """Queue sequences whose ids grew past what is cached (a new prompt or an observation).
        A new prompt joins the queued group of identical ids (from this call or an earlier one)."""
        for s in seqs:
            assert s.status in ("new", "paused"), s.status
            if s.status == "new":  # a fresh prompt: identical ones form a group
                group = self.new_groups.get(tuple(s.ids))
                if group is None:
                    group = self.new_groups[tuple(s.ids)] = []
                    self.new.append(group)
                group.append(s)
            else:
                self.returning.append([s])
            s.status = "waiting"

    def pause(self, seq: Sequence) -> None:
        self._leave(seq)
        seq.status = "paused"

    def finish(self, seq: Sequence) -> None:
        if seq.status == "running":
            self._leave(seq)
        self.blocks.release(seq.block_table)
        self.holders.pop(seq, None)
        seq.num_cached, seq.status = 0, "done"

    def evict(self, seq: Sequence) -> None:
        """Free a sequence's blocks; it is recomputed from its ids when it next runs."""
        self.blocks.release(seq.block_table)
        self.holders.pop(seq, None)
        seq.num_cached = 0
        self.evictions += 1
        if seq.status == "running":
            self._leave(seq)
            seq.status = "waiting"
            self.returning.appendleft([seq])
        # waiting: stays queued (now with all its ids pending); paused: recomputed when continued

    def _leave(self, seq: Sequence) -> None:
        if not self.rows_in_place:
            self.running.remove(seq)
            return
        i, last = self.running.index(seq), self.running.pop()
        if last is not seq:
            self.running[i] = last

    # -------------------------------------------------------------------------
    # the next forward

    def schedule(self, steps: int = 1) -> Batch | None:
        """The next forward: a prefill, or else a decode window of up to `steps` steps (Batch.steps)
        for which every running sequence's blocks are reserved now; a window the free blocks
        cannot hold shrinks to one step before anything is evicted."""
        batch = self._prefill()
        if batch.seqs:
            return batch
        # decode: step j writes the K/V of each running sequence's token at num_cached + j, up to
        # the second-to-last token its turn may sample (the last one is never written in its turn).
        # One pass over the rows finds those that need blocks (most need none in a given window);
        # only they are grown, in running order (the same blocks as growing every row).
        grow, need = self._decode_needs(steps)
        if steps > 1 and self.blocks.num_free < need:
            steps = 1
            grow, need = self._decode_needs(1)
        while self.running and self.blocks.num_free < need:
            self._evict_latest(keep=())
            grow, need = self._decode_needs(1)
        if not self.running:  # nothing to decode (or everything was evicted): prefill instead
            batch = self._prefill()
            return batch if batch.seqs else None
        for s, reach in grow:
            self.blocks.grow(s.block_table, s.num_cached, reach)
        return Batch("decode", list(self.running), steps=steps)

    def _prefill(self) -> Batch:
        batch = Batch("prefill", [])
        longest = 0
        while self.returning or self.new:
            queue = self.returning if self.returning else self.new
            group = queue[0]
            lead = group[0]
            pending = len(lead.ids) - lead.num_cached
            chunk = pending if batch.seqs else min(pending, self.prefill_tokens)  # only the first is cut
            if batch.seqs and (len(batch.seqs) + 1) * max(longest, chunk) > self.prefill_tokens:
                break
            if self.max_rows and len(self.running) + len(batch.seqs) + len(group) > self.max_rows:
                if self.running or batch.seqs:
                    break
            need = self.blocks.needed(lead.block_table, lead.num_cached, lead.num_cached + chunk)
            reserve = len(self.running)  # room for every running row to grow by a block
            if need + reserve > self.blocks.num_free:
                if self.running or batch.seqs:
                    break  # wait: running rows end and free blocks
                while need > self.blocks.num_free:  # nothing else can progress: evict a holder
                    self._evict_latest(keep=(lead,))
            self.blocks.grow(lead.block_table, lead.num_cached, lead.num_cached + chunk)
            self.holders.setdefault(lead, None)  # ordered by first admission: the latest go first
            batch.seqs.append(lead)
            batch.chunks.append(chunk)
            self.prefilled_tokens += chunk
            self.prefilled_prompt_tokens += chunk if queue is self.new else 0
            longest = max(longest, chunk)
            if chunk < pending:
                break  # the rest of this prompt goes in the next forward
            queue.popleft()
            if queue is self.new and self.new_groups.get(tuple(lead.ids)) is group:
                del self.new_groups[tuple(lead.ids)]  # prefilled: a later identical prompt starts a new group
            lead.followers = group[1:]
        return batch

    def _decode_needs(self, steps: int) -> tuple[list[tuple[Sequence, int]], int]:
        """([(row, tokens its table must cover)] for the running rows a decode window of `steps`
        steps takes blocks for, the blocks they take in all)."""
        grow, total = [], 0
        for s in self.running:
            reach = min(s.num_cached + steps, s.turn_start + s.budget - 1)
            n = self.blocks.needed(s.block_table, s.num_cached, reach)
            if n:
                grow.append((s, reach))
                total += n
        return grow, total

    def _evict_latest(self, keep: tuple) -> None:
        """Evict the most recently admitted sequence holding blocks (not one of `keep`)."""
        victim = next((s for s in reversed(self.holders) if s not in keep), None)
        if victim is None or (victim in self.running and len(self.running) == 1 and len(self.holders) == 1):
            raise RuntimeError(
                f"the KV cache ({self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens) cannot hold "
                f"one sequence: raise sampling.kv_budget_tokens (the longest needs up to max_context tokens)")
        self.evict(victim)

    def started(self, seqs: list[Sequence]) -> None:
        """Prefilled sequences (and the followers forked from them) join the decode batch."""
        for s in seqs:
            s.status, s.epoch = "running", s.epoch + 1
            self.running.append(s)
            self.holders.setdefault(s, None)
