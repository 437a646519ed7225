"""The sampler's engine: continuous batching over a paged KV cache, counter-based sampling.

    with Engine(model, sampling_cfg, stopper, worst_case=[...], dtype=torch.bfloat16) as engine:
        engine.add([Sequence(prompt_ids, key=row_key(seed, i), index=i) for i, ...])  # a turn starts
        while engine.busy():
            for seq in engine.step():     # one forward; the sequences whose turn just ended
                engine.finish(seq)        # or: append an observation to seq.ids, engine.add([seq])

One step: the scheduler picks the next forward (a prefill of queued sequences, or one decode
step of all running ones); the engine builds its inputs, runs the model, samples one token per
row (sampling.sample_next: the noise of a token depends on (key, position) only, so batching,
eviction and recomputation never change a sample), appends it with its logprob, and checks the
stop strings, EOS and the turn's budget. A turn ends on EOS, a stop string (kept), max_new_tokens
("length") or max_context.

Decode inputs live on the device and change incrementally: the sampled tokens feed the next step
as they are, positions advance on the device, and each step sends one small tensor (the slot each
row writes, which also updates the block tables) before reading the sampled tokens back, the one
host sync per step. On CUDA with sampling.cuda_graphs the decode forward replays a CUDA graph
captured per (batch size, block count) bucket. Tests: .venv/bin/pytest tests/test_engine.py
"""
from __future__ import annotations

import torch

from block_manager import BlockManager
from model import PagedBatch, PagedKVCache
from sampling import StopChecker, sample_next
from scheduler import Batch, Scheduler, Sequence

PREFILL_TOKENS = 16384  # padded tokens per prefill forward (bounds its attention mask and activations)


class Engine:
    MIRROR_ON_CPU = True  # decode reads a contiguous mirror of the batch's K/V (DecodeRows); tests turn it off

    def __init__(self, model, cfg, stopper: StopChecker, *, worst_case: list[int], greedy: bool = False,
                 dtype: torch.dtype | None = None, logits_hook=None):
        """cfg: config.SamplingConfig. worst_case: the most tokens each sequence of the work can
        reach (the pool holds the smaller of their sum and cfg.kv_budget_tokens). dtype: the KV
        cache's, i.e. the compute dtype (default: the parameters'). logits_hook(logits (B, V),
        seqs) -> logits: instrumentation for tests and benchmarks (scripted behaviour)."""
        self.model, self.cfg, self.stopper, self.greedy, self.hook = model, cfg, stopper, greedy, logits_hook
        weight = model.embed_tokens.weight
        self.device = weight.device
        bs = cfg.block_size
        if worst_case and cfg.kv_budget_tokens < max(worst_case):
            raise ValueError(f"sampling.kv_budget_tokens={cfg.kv_budget_tokens} cannot hold one sequence of "
                             f"{max(worst_case)} tokens (its prompt + turns, at most max_context): raise it")
        n_blocks = max(1, min(-(-cfg.kv_budget_tokens // bs), sum(-(-w // bs) for w in worst_case)))
        self.cache = PagedKVCache.for_model(model, n_blocks, bs, dtype or weight.dtype)
        self.blocks = BlockManager(n_blocks, bs)
        self.scheduler = Scheduler(self.blocks, cfg.max_rows, PREFILL_TOKENS)
        self.rows = DecodeRows(self.device, bs, self.cache.scratch, mirror=self.device.type == "cpu" and self.MIRROR_ON_CPU)
        self.graphs = None
        if cfg.cuda_graphs and self.device.type == "cuda":
            from cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, self.cache, max_blocks=-(-cfg.max_context // bs))
        # what a benchmark reads: steps, and per decode step the live rows and the blocks in use
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "live_rows": 0, "blocks_used": 0, "tokens_live": 0}
        self.steps = 0  # forwards run (the clock ToolCalls schedules by)

    def __enter__(self):
        self._was_training = self.model.training
        self.model.eval()
        return self

    def __exit__(self, *exc):
        self.model.train(self._was_training)
        self.cache = self.rows = self.graphs = None  # the pool is large: free it with the engine

    @property
    def evictions(self) -> int:
        return self.scheduler.evictions

    def busy(self) -> bool:
        return self.scheduler.busy()

    def add(self, seqs: list[Sequence]) -> None:
        """Start a turn for each sequence: a new prompt, or a paused one whose ids grew."""
        for s in seqs:
            s.turn_start, s.num_turns, s.stop_reason = len(s.ids), s.num_turns + 1, ""
            s.budget = min(self.cfg.max_new_tokens, self.cfg.max_context - len(s.ids))
            if s.budget <= 0:
                raise ValueError(f"sequence {s.index} has {len(s.ids)} tokens: no room below max_context")
        self.scheduler.add(seqs)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done: give its blocks back."""
        self.scheduler.finish(seq)

    # -------------------------------------------------------------------------
    # one step

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Run the next forward and sample; returns the sequences whose turn ended (now paused)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        self.steps += 1
        copies = self.blocks.pending_copies()
        if copies:
            src, dst = torch.tensor(copies, device=self.device).unbind(1)
            self.cache.copy_blocks(src, dst)
        if batch.kind == "prefill":
            logits, seqs, keys, positions = self._prefill(batch)
        else:
            logits, seqs, keys, positions = self._decode(batch.seqs)
        if not seqs:
            return []
        if self.hook is not None:
            logits = self.hook(logits, seqs)
        c = self.cfg
        tokens, logps = sample_next(logits, keys, positions, temperature=c.temperature, top_p=c.top_p,
                                    top_k=c.top_k, greedy=self.greedy)  # (B,), (B,)
        if batch.kind == "decode":
            self.rows.tokens = tokens  # the next step's input, never leaving the device
        return self._append(seqs, torch.stack([tokens.double(), logps.double()], 1).tolist())  # the host sync

    def _prefill(self, batch: Batch):
        """Feed each sequence's next chunk of uncached ids; the ones now fully cached sample."""
        self.stats["prefill_steps"] += 1
        bs, dev, scratch = self.blocks.block_size, self.device, self.cache.scratch
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
        logits = self.model(torch.tensor(ids, device=dev), positions=torch.tensor(positions, device=dev),
                            cache=cache, logits_at=last)  # (B, V)
        rows, sources = [], []
        for i, (s, n) in enumerate(zip(batch.seqs, batch.chunks)):
            s.num_cached += n
            if s.num_cached < len(s.ids):
                continue  # a long prompt's first chunks
            for f in s.followers:  # samples of the same prompt: share its blocks and its logits
                f.block_table, f.num_cached = self.blocks.share(s.block_table), s.num_cached
            rows += [s] + s.followers
            sources += [i] * (1 + len(s.followers))
            s.followers = []
        self.scheduler.started(rows)
        keys = torch.tensor([s.key for s in rows], device=dev)
        positions = torch.tensor([len(s.ids) for s in rows], device=dev)  # index of the token to sample
        return logits[torch.tensor(sources, device=dev)], rows, keys, positions

    def _decode(self, seqs: list[Sequence]):
        """One token per running sequence: its last sampled token goes into the cache."""
        st = self.stats
        st["decode_steps"] += 1
        st["live_rows"] += len(seqs)
        st["blocks_used"] += self.blocks.num_used
        st["tokens_live"] += sum(s.num_cached + 1 for s in seqs)
        bs = self.blocks.block_size
        rows = self.rows
        rows.sync(seqs)
        slots = [s.block_table[s.num_cached // bs] * bs + s.num_cached % bs for s in seqs]
        blocks = max(s.num_cached // bs for s in seqs) + 1  # the most blocks a row attends over
        slots = torch.tensor(slots, device=self.device)  # (B,) the one host -> device copy per step
        rows.set_written_blocks(slots // bs, blocks)  # new or copied-on-write blocks enter the tables
        logits = None
        if self.graphs is not None:
            logits = self.graphs.run(rows.tokens, rows.positions, slots, rows.tables, blocks)
        if logits is None:
            cache = PagedBatch(self.cache, slots[:, None], rows.tables[:, :blocks], rows.mirror(self.cache, blocks))
            logits = self.model(rows.tokens[:, None], positions=rows.positions[:, None], cache=cache)[:, -1]
        for s in seqs:
            s.num_cached += 1
        rows.positions = rows.positions + 1
        return logits, seqs, rows.keys, rows.positions  # sampled token's index = new cache length

    def _append(self, seqs: list[Sequence], sampled: list[list[float]]) -> list[Sequence]:
        ended = []
        max_new = self.cfg.max_new_tokens
        for s, (token, logp) in zip(seqs, sampled):
            s.ids.append(int(token))
            s.loss_mask.append(1)
            s.logprobs.append(logp)
            reason = self.stopper.check(s.ids, s.turn_start)
            if reason is None and len(s.ids) - s.turn_start >= s.budget:
                reason = "max_context" if s.budget < max_new else "length"
            if reason:
                s.stop_reason = reason
                self.scheduler.pause(s)
                ended.append(s)
        return ended


# -----------------------------------------------------------------------------
# device-side state of the decode batch


class DecodeRows:
    """The decode batch's inputs on the device, one row per running sequence, kept across steps.

    tokens (B,): each row's last sampled token (the next input); positions (B,): its position
    (= tokens cached before it); keys (B,): sampling keys; tables (B, W): block tables padded with
    the scratch block, W grown by doubling. When the batch changes (rows end, join or are evicted)
    the rows that stay are selected on the device; only joining rows are built on the host. A row
    is identified by (sequence, epoch): a sequence that left and came back is a new row.

    With mirror (CPU), the batch's K/V are also kept in one contiguous tensor per K and V,
    (n_layers, B, Hk, W tokens, D), gathered from the blocks once the batch has stayed the same for
    MIRROR_AFTER steps and then appended to by every step: a CPU decode step reads them as they are
    instead of gathering every row's blocks again (on a CPU that gather costs as much as the
    attention). Building it costs about two gathers, so a batch that changes every step (rows
    ending turns at different times, as in real rollouts) gathers instead.
    """

    MIRROR_AFTER = 2  # unchanged decode steps before the mirror is built

    def __init__(self, device, block_size: int, scratch: int, mirror: bool = False):
        self.device, self.block_size, self.scratch, self.mirrored = device, block_size, scratch, mirror
        self.ids: list[tuple[Sequence, int]] = []
        long = dict(dtype=torch.long, device=device)
        self.tokens, self.positions, self.keys = (torch.zeros(0, **long) for _ in range(3))
        self.tables = torch.full((0, 1), scratch, **long)
        self.mirror_kv = None  # (k, v): (n_layers, B, Hk, W, D), valid for self.ids
        self.unchanged = 0  # decode steps since the batch last changed

    def sync(self, seqs: list[Sequence]) -> None:
        ids = [(s, s.epoch) for s in seqs]
        if ids == self.ids:
            self.unchanged += 1
            return
        old = {r: i for i, r in enumerate(self.ids)}
        kept = [(i, old[r]) for i, r in enumerate(ids) if r in old]
        joining = [i for i, r in enumerate(ids) if r not in old]
        width = self.tables.shape[1]
        while any(len(seqs[i].block_table) > width for i in joining):
            width *= 2
        long = dict(dtype=torch.long, device=self.device)
        B = len(seqs)
        tokens, positions, keys = (torch.zeros(B, **long) for _ in range(3))
        tables = torch.full((B, width), self.scratch, **long)
        if kept:
            new, src = (torch.tensor(x, device=self.device) for x in zip(*kept))
            tokens[new], positions[new], keys[new] = self.tokens[src], self.positions[src], self.keys[src]
            tables[new, :self.tables.shape[1]] = self.tables[src]
        if joining:
            new = torch.tensor(joining, device=self.device)
            js = [seqs[i] for i in joining]
            tokens[new] = torch.tensor([s.ids[-1] for s in js], **long)
            positions[new] = torch.tensor([s.num_cached for s in js], **long)
            keys[new] = torch.tensor([s.key for s in js], **long)
            tables[new] = torch.tensor([s.block_table + [self.scratch] * (width - len(s.block_table)) for s in js],
                                       **long)
        self.ids, self.tokens, self.positions, self.keys, self.tables = ids, tokens, positions, keys, tables
        self.mirror_kv, self.unchanged = None, 0

    def set_written_blocks(self, blocks: torch.Tensor, width: int) -> None:
        """tables[b, positions[b] // block_size] := blocks[b]: between steps the only entry that can
        change is the block a row writes into (a new block, or a copy of a shared one)."""
        if width > self.tables.shape[1]:
            pad = torch.full((self.tables.shape[0], max(width, 2 * self.tables.shape[1]) - self.tables.shape[1]),
                             self.scratch, dtype=torch.long, device=self.device)
            self.tables = torch.cat([self.tables, pad], 1)
        rows = torch.arange(self.tables.shape[0], device=self.device)
        self.tables[rows, self.positions // self.block_size] = blocks

    def mirror(self, cache: PagedKVCache, blocks: int):
        """(k, v, rows) for PagedBatch.mirror, or None (no mirror, or a batch that changed in the last
        MIRROR_AFTER steps: gather instead): gathered from the blocks, then as the last step left it. It holds as many blocks as any row can
        reach in its turn (turn start + budget), so it never grows while the batch is unchanged."""
        if not self.mirrored or (self.mirror_kv is None and self.unchanged < self.MIRROR_AFTER):
            return None  # gather this step
        L, _, bs, Hk, D = cache.k.shape
        B = len(self.ids)
        if self.mirror_kv is None or self.mirror_kv[0].shape[3] < blocks * bs:
            width = max(blocks, max(-(-(s.turn_start + s.budget) // bs) for s, _ in self.ids))
            table = torch.full((B, width), self.scratch, dtype=torch.long, device=self.device)
            w = min(width, self.tables.shape[1])
            table[:, :w] = self.tables[:, :w]
            table = table.reshape(-1)
            self.mirror_kv = tuple(torch.empty(L, B, Hk, width * bs, D, dtype=cache.k.dtype, device=self.device)
                                   for _ in range(2))  # (L, B, Hk, W, D): what SDPA reads fastest
            for pool, mirror in zip((cache.k, cache.v), self.mirror_kv):
                for layer in range(L):
                    blocks_kv = pool[layer].index_select(0, table).view(B, width * bs, Hk, D)
                    mirror[layer].copy_(blocks_kv.transpose(1, 2))
        k, v = self.mirror_kv
        W = k.shape[3]
        rows = (torch.arange(B * Hk, device=self.device).view(B, Hk) * W + self.positions[:, None]).reshape(-1)
        return k, v, rows  # rows: the new token's (row, head) rows of k[layer].view(-1, D)
