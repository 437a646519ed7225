"""The sampler's model runner: a forward's inputs and attention metadata, the forward, the samples.

engine.py decides what runs (scheduler.py) and what the samples mean for each sequence; this file
turns that into tensors and back. Two kinds of work:

    runner = ModelRunner(model, cache, sampling_cfg, candidates, greedy, logits_hook)
    rows, sampled = runner.prefill(batch)      # chunks of queued sequences; rows now fully cached
                                               # sample their first token: sampled [(token, logp)]
    window = runner.decode(seqs, steps)        # `steps` decode steps of the running sequences,
                                               # read back once: window.tokens[b][:window.new[b]]

Decode keeps the host off the per-token path. Every running row's state lives on the device
(DecodeRows: last token, position, sampling key, block table, tokens left in its turn). A decode
window runs `steps` forwards back to back: slots come from the block tables and positions on the
device, the sampled tokens feed the next step where they are, and a row stops (stays frozen: no
new state, K/V written to the scratch block) once it samples a token that may end its turn (EOS,
or one that can complete a stop string: StopChecker.candidates) or uses up its turn's budget.
The sampled tokens and logprobs reach the host once per window, as (B, steps) tensors; the host
then re-checks only the rows that stopped. Block tables change only between windows (the
scheduler reserves each row's blocks for the whole window first), so no host work per step
grows with the batch.

On CUDA with sampling.cuda_graphs the decode forward replays a graph per (batch, blocks) bucket
(cuda_graphs.py). Tests: .venv/bin/pytest tests/test_engine.py tests/test_sampling.py
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.paged_attention import PagedBatch, PagedKVCache
from engine.decode_kv import DecodeKV
from engine.decode_step import DecodeState, decode_step
from engine.sampling import SamplingParams, sample_next
from engine.scheduler import Batch, Sequence


@dataclass
class DecodeWindow:
    """What one decode window sampled, on the host. Row b sampled tokens[b][:new[b]] (and their
    logprobs); stopped[b]: it stopped on a possible turn end (the last of those tokens)."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    new: list[int]
    stopped: list[bool]


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, cfg, candidates: torch.Tensor, *, window: int,
                 greedy: bool = False, logits_hook=None):
        """cfg: config.SamplingConfig. candidates (V,) bool: tokens that may end a turn (EOS, stop
        strings). window: the most decode steps between two host reads. logits_hook(logits (B, V),
        seqs) -> logits: tests and benchmarks."""
        self.model, self.cache, self.cfg = model, cache, cfg
        self.device = cache.k.device
        # on CUDA the step samples without a host read (rows it cannot settle are sampled after the
        # window); on CPU a read is free, so every row is sampled exactly inside the step
        self.on_device = self.device.type == "cuda"
        self.graphs = None
        if cfg.cuda_graphs and self.device.type == "cuda":
            from engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, cache, -(-cfg.max_context // cache.block_size), window,
                                       candidates.to(self.device), compile=cfg.compile_decode)
        self.reset(candidates, greedy=greedy, logits_hook=logits_hook)

    def reset(self, candidates: torch.Tensor, *, greedy: bool = False, logits_hook=None) -> None:
        """A new run: its turn-end candidates, sampling, greedy flag and hook; no device rows (the
        graphs stay)."""
        self.greedy, self.hook = greedy, logits_hook
        self.params = SamplingParams.of(self.cfg, greedy)
        self.host_samples = 0  # tokens the device left to the host sampler (wide top-p nuclei)
        self.candidates = candidates.to(self.device)
        if self.graphs is not None:
            self.graphs.set_candidates(self.candidates)
        # the eager gather path keeps the rows' K/V copied out across steps (decode_kv.py); graphs
        # replay steps that do not update such a copy, and flex reads the pool in place
        kv = DecodeKV(self.cache, -(-self.cfg.max_context // self.cache.block_size) * self.cache.block_size) \
            if self.graphs is None and self.cache.attention == "gather" else None
        self.rows = DecodeRows(self.device, self.cache.block_size, self.cache.scratch, kv)

    def sample(self, logits, keys, positions, seqs):
        """tokens (B,), logprobs (B,) for logits (B, V); positions: the sampled tokens' indices."""
        if self.hook is not None:
            logits = self.hook(logits, seqs)
        p = self.params
        return sample_next(logits, keys, positions, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                           greedy=p.greedy)

    # -------------------------------------------------------------------------
    # prefill: feed queued ids (a prompt, an observation, a recomputation) into the cache

    def prefill(self, batch: Batch, share) -> tuple[list[Sequence], list[list[float]]]:
        """Feed each sequence's next chunk of uncached ids; the ones now fully cached (and the
        samples sharing their prompt: share(lead, follower) gives them its blocks) sample one
        token each. Returns those rows and [token, logprob] per row (one host read)."""
        bs, dev, scratch = self.cache.block_size, self.device, self.cache.scratch
        T = max(batch.chunks)
        ids, positions, slots, tables = [], [], [], []
        for s, n in zip(batch.seqs, batch.chunks):
            start = s.num_cached
            ids.append(s.ids[start:start + n] + [0] * (T - n))
            positions.append(list(range(start, start + T)))  # padding continues harmlessly
            slots.append([s.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
                         + [scratch * bs] * (T - n))
            tables.append(s.block_table)
        fresh = all(s.num_cached == 0 for s in batch.seqs)
        width = max(map(len, tables))
        table = None if fresh else torch.tensor([t + [scratch] * (width - len(t)) for t in tables], device=dev)
        cache = PagedBatch(self.cache, torch.tensor(slots, device=dev), table)
        last = torch.tensor(batch.chunks, device=dev) - 1
        logits = self.model.forward_paged(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), cache,
                                          logits_at=last)  # (B, V)
        rows, sources = [], []
        for i, (s, n) in enumerate(zip(batch.seqs, batch.chunks)):
            s.num_cached += n
            if s.num_cached < len(s.ids):
                continue  # a long prompt's first chunks
            for f in s.followers:  # samples of the same prompt: share its blocks and its logits
                share(s, f)
            rows += [s] + s.followers
            sources += [i] * (1 + len(s.followers))
            s.followers = []
        if not rows:
            return [], []
        keys = torch.tensor([s.key for s in rows], device=dev)
        positions = torch.tensor([len(s.ids) for s in rows], device=dev)  # index of the token to sample
        tokens, logps = self.sample(logits[torch.tensor(sources, device=dev)], keys, positions, rows)
        return rows, torch.stack([tokens.double(), logps.double()], 1).tolist()  # the host read

    # -------------------------------------------------------------------------
    # decode: `steps` tokens per running row, one host read

    def decode(self, seqs: list[Sequence], steps: int) -> DecodeWindow:
        """Run `steps` decode steps of seqs (their blocks already cover every token they write).
        Each row's first input is its last sampled token (ids[-1], position num_cached)."""
        rows, bs = self.rows, self.cache.block_size
        rows.sync(seqs)
        B = len(seqs)
        # the most blocks any row attends over in this window: its last step's position
        blocks = min((max(s.num_cached for s in seqs) + steps - 1) // bs + 1, rows.tables.shape[1])
        state = None
        if self.graphs is not None and self.hook is None and steps <= self.graphs.window:
            state = self.graphs.load(rows.tokens, rows.positions, rows.keys, rows.left, rows.tables, blocks)
        if state is not None:  # the static buffers of a graph bucket: K replays, nothing else
            for _ in range(steps):
                self.graphs.replay(state, self.params)
        else:  # the same step, eagerly, on the rows' own tensors (updated in place)
            state = DecodeState(rows.tokens, rows.positions, rows.keys, rows.left, rows.tables[:, :blocks],
                                active=torch.ones(B, dtype=torch.bool, device=self.device),
                                inexact=torch.zeros(B, dtype=torch.bool, device=self.device),
                                new=torch.zeros(B, dtype=torch.long, device=self.device),
                                step=torch.zeros((), dtype=torch.long, device=self.device),
                                out_tokens=torch.zeros(B, steps, dtype=torch.long, device=self.device),
                                out_logps=torch.zeros(B, steps, dtype=torch.float32, device=self.device))
            hook = (lambda logits: self.hook(logits, seqs)) if self.hook is not None else None
            kv = rows.kv if self.cache.attention == "gather" else None  # (flex may have fallen back)
            if kv is not None:
                kv.fit(rows.tables, blocks * bs)
            for _ in range(steps):
                decode_step(self.model, self.cache, state, self.candidates, self.params, on_device=self.on_device,
                            logits_hook=hook, kv=kv)
        # one host read: (B, steps) tokens and logprobs, tokens kept, stopped, left to the host sampler
        packed = torch.cat([state.out_tokens[:B, :steps].double(), state.out_logps[:B, :steps].double(),
                            state.new[:B, None].double(), (~state.active[:B])[:, None].double(),
                            state.inexact[:B, None].double()], 1).cpu()
        if state.tokens.data_ptr() != rows.tokens.data_ptr():  # graph buffers: the rows' state moved on there
            rows.tokens, rows.positions, rows.left = state.tokens[:B].clone(), state.positions[:B].clone(), \
                state.left[:B].clone()
        window = DecodeWindow(packed[:, :steps].long().tolist(), packed[:, steps:2 * steps].tolist(),
                              packed[:, -3].long().tolist(), (packed[:, -2] > 0).tolist())
        inexact = (packed[:, -1] > 0).nonzero().squeeze(-1).tolist()
        if inexact:
            self._sample_exact(window, inexact)
        return window

    def _sample_exact(self, window: DecodeWindow, inexact: list[int]) -> None:
        """The rows whose last step drew a top-p sample the device could not settle (a nucleus wider
        than the prefilter): sample that token exactly on the host and append it. The row's input
        token was written to the cache by that step, so its logits are recomputed with the new K/V
        sent to the scratch block."""
        rows, bs = self.rows, self.cache.block_size
        self.host_samples += len(inexact)
        sel = torch.tensor(inexact, device=self.device)
        tokens, positions, keys = rows.tokens[sel], rows.positions[sel], rows.keys[sel]
        blocks = min(int(positions.max()) // bs + 1, rows.tables.shape[1])
        slots = torch.full((len(inexact), 1), self.cache.scratch * bs, dtype=torch.long, device=self.device)
        cache = PagedBatch(self.cache, slots, rows.tables[sel, :blocks])
        logits = self.model.forward_paged(tokens[:, None], positions[:, None], cache)[:, -1]
        p = self.params
        token, logp = sample_next(logits, keys, positions + 1, temperature=p.temperature, top_p=p.top_p,
                                  top_k=p.top_k, greedy=p.greedy)
        rows.tokens[sel], rows.positions[sel], rows.left[sel] = token, positions + 1, rows.left[sel] - 1
        for i, t, lp in zip(inexact, token.tolist(), logp.double().tolist()):
            n = window.new[i]
            window.tokens[i] = window.tokens[i][:n] + [t]
            window.logprobs[i] = window.logprobs[i][:n] + [lp]
            window.new[i] = n + 1
            window.stopped[i] = True  # the host checks whether the token ended the turn


# -----------------------------------------------------------------------------
# device-side state of the decode batch


class DecodeRows:
    """The decode batch's inputs on the device, one row per running sequence, kept across windows.

    tokens (B,): each row's last sampled token (the next input); positions (B,): its position
    (= tokens cached before it); keys (B,): sampling keys; left (B,): tokens its turn may still
    sample; tables (B, W): block tables padded with the scratch block. When the batch changes
    (rows end, join or are evicted) the rows that stay are selected on the device; only joining
    rows are built on the host. A row is identified by (sequence, epoch): a sequence that left and
    came back is a new row. A staying row's table is re-sent only when its block list grew or
    changed (scheduler: reserved for a window, or copied on write). kv: the rows' K/V copied out of
    the pool (decode_kv.py, eager gather path), moved with the rows; None when not kept.
    """

    def __init__(self, device, block_size: int, scratch: int, kv: DecodeKV | None = None):
        self.device, self.block_size, self.scratch, self.kv = device, block_size, scratch, kv
        self.ids: list[tuple[Sequence, int]] = []
        self.sent: list[list[int]] = []  # the block table each row's device table holds
        long = dict(dtype=torch.long, device=device)
        self.tokens, self.positions, self.keys, self.left = (torch.zeros(0, **long) for _ in range(4))
        self.tables = torch.full((0, 1), scratch, **long)

    def sync(self, seqs: list[Sequence]) -> None:
        """Make the device rows those of seqs, in order; tables of staying rows brought up to date."""
        ids = [(s, s.epoch) for s in seqs]
        if ids == self.ids:
            changed = [i for i, s in enumerate(seqs) if s.block_table != self.sent[i]]
            if changed:  # grown (a reserved window) or a block copied on write
                self.fit_tables(max(len(seqs[i].block_table) for i in changed))
                self._send_tables(changed, seqs)
            return
        old = {r: i for i, r in enumerate(self.ids)}
        kept = [(i, old[r]) for i, r in enumerate(ids) if r in old]
        joining = [i for i, r in enumerate(ids) if r not in old]
        width = max(self.tables.shape[1], max(len(s.block_table) for s in seqs))
        long = dict(dtype=torch.long, device=self.device)
        B = len(seqs)
        tokens, positions, keys, left = (torch.zeros(B, **long) for _ in range(4))
        tables = torch.full((B, width), self.scratch, **long)
        new = src = None
        if kept:
            new, src = (torch.tensor(x, device=self.device) for x in zip(*kept))
            tokens[new], positions[new], keys[new] = self.tokens[src], self.positions[src], self.keys[src]
            left[new] = self.left[src]
            tables[new, :self.tables.shape[1]] = self.tables[src]
        if self.kv is not None:
            self.kv.select(B, new, src, torch.tensor(joining, device=self.device) if joining else None)
        if joining:
            new = torch.tensor(joining, device=self.device)
            js = [seqs[i] for i in joining]
            host = torch.tensor([[s.ids[-1], s.num_cached, s.key, s.budget - (len(s.ids) - s.turn_start)]
                                 for s in js], **long)
            tokens[new], positions[new], keys[new], left[new] = host.unbind(1)
        self.ids, self.tokens, self.positions, self.keys, self.left, self.tables = \
            ids, tokens, positions, keys, left, tables
        sent = [self.sent[old[r]] if r in old else None for r in ids]
        self.sent = sent
        self._send_tables([i for i, s in enumerate(seqs) if s.block_table != sent[i]], seqs)

    def _send_tables(self, rows: list[int], seqs: list[Sequence]) -> None:
        if not rows:
            return
        W = self.tables.shape[1]
        table = [seqs[i].block_table + [self.scratch] * (W - len(seqs[i].block_table)) for i in rows]
        self.tables[torch.tensor(rows, device=self.device)] = torch.tensor(table, dtype=torch.long, device=self.device)
        for i in rows:
            self.sent[i] = list(seqs[i].block_table)

    def fit_tables(self, width: int) -> None:
        """Widen the tables (scratch-padded, at least doubling) to hold `width` blocks."""
        if width > self.tables.shape[1]:
            pad = torch.full((self.tables.shape[0], max(width, 2 * self.tables.shape[1]) - self.tables.shape[1]),
                             self.scratch, dtype=torch.long, device=self.device)
            self.tables = torch.cat([self.tables, pad], 1)
