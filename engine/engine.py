"""The sampler's engine: continuous batching over a paged KV cache, counter-based sampling.

    with Engine(model, sampling_cfg, stopper, worst_case=[...], dtype=torch.bfloat16) as engine:
        engine.add([Sequence(prompt_ids, key=row_key(seed, i), index=i) for i, ...])  # a turn starts
        while engine.busy():
            for seq in engine.step():     # a forward (or a decode window); the turns that ended
                engine.finish(seq)        # or: append an observation to seq.ids, engine.add([seq])

The loop is schedule -> run -> postprocess. The scheduler (scheduler.py) picks the next work: a
prefill of queued sequences, or a decode window of every running one (up to
sampling.decode_steps_per_sync steps, blocks reserved for all of them). The model runner
(model_runner.py) builds the inputs, runs the forwards and samples (sampling.sample_next: the
noise of a token depends on (key, position) only, so batching, windows, eviction and
recomputation never change a sample); a decode window reads its tokens back once. Postprocess
appends the tokens and logprobs and decides which turns ended: EOS, a stop string (kept),
max_new_tokens ("length") or max_context. The device stops a row at a token that may end its
turn; the host re-checks only those rows (a false alarm decodes on in the next window).

With a logits hook (tests, benchmarks: it reads each row's ids) every window is one step. A step
in which nothing moves (no row took a token or ended its turn, or rows wait and nothing can be
scheduled) raises EngineStalled naming the rows, so a broken stop or budget rule fails at once
instead of looping.
Tests: .venv/bin/pytest tests/test_engine.py tests/test_sampling.py
"""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import FSDPModule

from engine.block_manager import BlockManager
from engine.paged_attention import PagedKVCache
from engine.model_runner import ModelRunner
from engine.sampling import StopChecker
from engine.scheduler import Scheduler, Sequence


class EngineStalled(RuntimeError):
    """A step in which no row moved (no token taken, no turn ended, nothing scheduled while rows
    wait): a bug in a stop or budget rule, raised at once instead of looping forever."""


def window_steps(cfg, device: torch.device) -> int:
    """Decode steps per host read: sampling.decode_steps_per_sync, or when 0, 8 on CUDA (where a read
    is a device sync and windows keep the GPU busy) and 1 elsewhere (a CPU forward costs about the
    same for idle rows, and a window holds finished rows and new turns back until it ends)."""
    if cfg.decode_steps_per_sync:
        return cfg.decode_steps_per_sync
    return 8 if device.type == "cuda" else 1


class Engine:
    def __init__(self, model, cfg, stopper: StopChecker, *, worst_case: list[int], greedy: bool = False,
                 dtype: torch.dtype | None = None, logits_hook=None):
        """cfg: config.SamplingConfig. worst_case: the most tokens each sequence of the work can
        reach (the pool holds the smaller of their sum and cfg.kv_budget_tokens; auto: their sum). dtype: the KV
        cache's, i.e. the compute dtype (default: the parameters'). logits_hook(logits (B, V),
        seqs) -> logits: instrumentation for tests and benchmarks (scripted behaviour)."""
        if isinstance(model, FSDPModule):
            raise ValueError("the engine samples a plain model: a sharded one samples through its "
                             "policy_sampler.PolicySampler (an inference copy refreshed from it)")
        self.model, self.cfg, self.stopper = model, cfg, stopper
        weight = model.embed_tokens.weight
        self.device = weight.device
        bs = cfg.block_size
        if cfg.kv_budget_tokens == "auto":
            # the engine knows its work, not the device's memory: auto holds the work whole (a caller
            # that must fit memory sizes auto first, trainer/memory.py)
            cfg = dataclasses.replace(cfg, kv_budget_tokens=max(1, sum(worst_case)))
            self.cfg = cfg
        if worst_case and cfg.kv_budget_tokens < max(worst_case):
            raise ValueError(f"sampling.kv_budget_tokens={cfg.kv_budget_tokens} cannot hold one sequence of "
                             f"{max(worst_case)} tokens (its prompt + turns, at most max_context): raise it")
        if cfg.decode_steps_per_sync < 0:
            raise ValueError(f"sampling.decode_steps_per_sync={cfg.decode_steps_per_sync} must be >= 0 (0 = by device)")
        n_blocks = max(1, min(-(-cfg.kv_budget_tokens // bs), sum(-(-w // bs) for w in worst_case)))
        self.cache = PagedKVCache.for_model(model, n_blocks, bs, dtype or weight.dtype, cfg.paged_attention)
        self.runner = ModelRunner(model, self.cache, cfg, stopper.candidates(model.config.vocab_size),
                                  window=window_steps(cfg, self.device), greedy=greedy, logits_hook=logits_hook)
        self.version = 0  # the weights' version each sampled token records (kept across resets)
        self.resets = 0  # runs started on this pool: a caller sees whether another used it since its own
        self.reset(stopper, worst_case=worst_case, greedy=greedy, logits_hook=logits_hook)

    def reset(self, stopper: StopChecker, *, worst_case: list[int], greedy: bool = False, logits_hook=None,
              cfg=None, rows_in_place: bool = False) -> None:
        """Start a new run (a rollout) on the same KV pool, runner and CUDA graphs: a fresh
        scheduler and block table (the pool's contents are stale and overwritten before they are
        read), the run's stop rules, greedy flag, logits hook and sampling config (cfg: default
        the current; same block size), zeroed counters; rows_in_place: the scheduler's (a leaving
        row's place taken by the last row: fewer device moves for a batch that changes every step,
        as a stream's does; the rows' order, and so the floats of a batched matmul, then differ
        from the joining order's). A persistent
        engine (policy_sampler.py) calls it before every rollout; the weights it reads are the
        model's parameters in place, so graphs captured in an earlier run replay the new ones."""
        if cfg is not None:
            if cfg.block_size != self.cache.block_size:
                raise ValueError(f"sampling.block_size={cfg.block_size}: the engine's pool has blocks of "
                                 f"{self.cache.block_size}")
            self.cfg = self.runner.cfg = cfg
        bs, n_blocks = self.cfg.block_size, self.cache.scratch
        if worst_case and n_blocks * bs < max(worst_case):
            raise ValueError(f"the engine's KV pool ({n_blocks * bs} tokens) cannot hold one sequence of "
                             f"{max(worst_case)} tokens: raise sampling.kv_budget_tokens")
        self.stopper = stopper
        self.blocks = BlockManager(n_blocks, bs)
        self.scheduler = Scheduler(self.blocks, self.cfg.max_decode_rows, self.cfg.prefill_tokens, rows_in_place)
        self.runner.reset(stopper.candidates(self.model.config.vocab_size), greedy=greedy, logits_hook=logits_hook)
        self.resets += 1
        self.window = 1 if logits_hook is not None else window_steps(self.cfg, self.device)
        # what a benchmark reads: steps, and per decode step the live rows and the blocks in use
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "live_rows": 0, "blocks_used": 0, "tokens_live": 0}
        self.steps = 0  # forwards run since the reset

    def __enter__(self):
        self._was_training = self.model.training
        self.model.eval()
        return self

    def __exit__(self, *exc):
        self.model.train(self._was_training)
        self.cache = self.runner = None  # the pool is large: free it with the engine

    @property
    def evictions(self) -> int:
        return self.scheduler.evictions

    def counters(self) -> dict:
        """What the work since the last reset cost: stats (steps; per decode step summed: live_rows,
        blocks_used, tokens_live) plus evictions, prefill_tokens (tokens fed to prefill forwards:
        prompts, observations with the turn's last sampled token, recomputed rows), prompt_prefill_tokens
        (of them, new prompts': once per distinct prompt), peak_blocks (most KV blocks in use at once)
        and pool_blocks (the pool's size)."""
        sched = self.scheduler
        return dict(self.stats, evictions=self.evictions, prefill_tokens=sched.prefilled_tokens,
                    prompt_prefill_tokens=sched.prefilled_prompt_tokens, peak_blocks=self.blocks.peak_used,
                    pool_blocks=self.blocks.num_blocks)

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

    def readmit(self, seqs: list[Sequence]) -> None:
        """Sequences of an earlier run, continued on this one (after reset: their K/V are gone).
        Each is recomputed from its ids by a prefill, as an evicted row is: a row in mid-turn (running
        or waiting) is queued and continues its turn where it stopped; a paused one (its turn ended)
        waits for add() as before. Tokens and their randomness are per position, so a recomputed row
        samples what it would have, up to the floats of its K/V (now computed by the current weights)."""
        for s in seqs:
            assert s.status in ("running", "waiting", "paused"), s.status
            s.block_table, s.num_cached, s.followers = [], 0, []
            if s.status != "paused":
                s.status = "waiting"
                self.scheduler.returning.append([s])

    # -------------------------------------------------------------------------
    # one step: schedule -> run -> postprocess

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Run the next prefill forward or decode window; returns the sequences whose turn ended
        (now paused)."""
        running = self.scheduler.running
        steps = min(self.window, max((s.budget - (len(s.ids) - s.turn_start) for s in running), default=1))
        batch = self.scheduler.schedule(steps)
        if batch is None:
            if self.busy():  # rows wait, yet nothing can be scheduled: every later step would do the same
                raise EngineStalled(self._stall("no forward could be scheduled", self.scheduler.running))
            return []
        copies = self.blocks.pending_copies()
        if copies:
            src, dst = torch.tensor(copies, device=self.device).unbind(1)
            self.cache.copy_blocks(src, dst)
        if batch.kind == "prefill":
            self.steps += 1
            self.stats["prefill_steps"] += 1
            rows, sampled = self.runner.prefill(batch, self._share)
            self.scheduler.started(rows)
            return self._append(rows, sampled)
        self.steps += batch.steps
        self._count_decode(batch.seqs, batch.steps)
        window = self.runner.decode(batch.seqs, batch.steps)
        ended = self._append_window(batch.seqs, window)
        if not ended and not any(window.new):  # no row took a token, none ended: the next window repeats this one
            raise EngineStalled(self._stall(f"a decode window of {batch.steps} step(s) moved no row", batch.seqs))
        return ended

    def _stall(self, what: str, rows: list[Sequence]) -> str:
        """The error of a step in which nothing moved, naming the rows and where each stands."""
        shown = [f"row {s.index} (turn {s.num_turns}: {len(s.ids) - s.turn_start} of its budget {s.budget} "
                 f"tokens sampled, {len(s.ids)} of sampling.max_context {self.cfg.max_context} in all, "
                 f"status {s.status})" for s in rows[:4]]
        more = f" and {len(rows) - 4} more" if len(rows) > 4 else ""
        return (f"engine step {self.steps}: {what}; it would loop forever. Rows: {', '.join(shown) or 'none running'}"
                f"{more}; {len(self.scheduler.returning) + len(self.scheduler.new)} waiting, "
                f"{self.blocks.num_free} free KV blocks. A row whose budget is spent must end its turn "
                f"(Engine._turn_end) before the next window")

    def _share(self, lead: Sequence, follower: Sequence) -> None:
        follower.block_table, follower.num_cached = self.blocks.share(lead.block_table), lead.num_cached

    def _count_decode(self, seqs: list[Sequence], steps: int) -> None:
        """Benchmark counters, as if every row stayed live for the whole window."""
        st = self.stats
        st["decode_steps"] += steps
        st["live_rows"] += len(seqs) * steps
        st["blocks_used"] += self.blocks.num_used * steps
        st["tokens_live"] += steps * sum(s.num_cached + 1 for s in seqs) + len(seqs) * steps * (steps - 1) // 2

    def _append(self, seqs: list[Sequence], sampled: list[list[float]]) -> list[Sequence]:
        """One sampled token per sequence (a prefill): append it, end the turns that ended."""
        ended = []
        for s, (token, logp) in zip(seqs, sampled):
            s.ids.append(int(token))
            s.loss_mask.append(1)
            s.logprobs.append(logp)
            s.versions.append(self.version)
            if self._turn_end(s):
                ended.append(s)
        return ended

    def _append_window(self, seqs: list[Sequence], window) -> list[Sequence]:
        """A decode window's tokens: row b sampled window.new[b] tokens; only a row the device
        stopped can have ended its turn (its last token)."""
        ended = []
        steps = len(window.tokens[0]) if seqs else 0
        ones, versions = [1] * steps, [self.version] * steps
        for s, tokens, logps, n, stopped in zip(seqs, window.tokens, window.logprobs, window.new, window.stopped):
            if n == steps:  # most rows: the whole window, no slices copied
                s.ids += tokens
                s.logprobs += logps
                s.loss_mask += ones
                s.versions += versions
            else:
                s.ids += tokens[:n]
                s.logprobs += logps[:n]
                s.loss_mask += ones[:n]
                s.versions += versions[:n]
            s.num_cached += n
            if stopped and self._turn_end(s):
                ended.append(s)
        return ended

    def _turn_end(self, s: Sequence) -> bool:
        reason = self.stopper.check(s.ids, s.turn_start)
        if reason is None and len(s.ids) - s.turn_start >= s.budget:
            reason = "max_context" if s.budget < self.cfg.max_new_tokens else "length"
        if reason:
            s.stop_reason = reason
            self.scheduler.pause(s)
        return bool(reason)


