"""The stream of a run's training episodes: which prompts each GRPO step trains on, sampled up to
stream.sampling_steps_ahead = k steps ahead of the step that trains them.

    stream = RolloutStream(sampler, tokenizer, train_examples, cfg, rank, world)
    episodes = stream.next_round(step, phase, first_group)   # a round: the next chunk's episodes, ended, rewarded
    metrics = stream.step_metrics(trained_trajectories, step, device)   # the tail and the staleness (collective)
    stream.state_dict() / stream.load_state_dict(state)     # a checkpoint's episodes in flight

The units of work. A step is one GRPO step and a group the grpo.group_size episodes of one prompt
(each defined where its code lives: train.py, grpo.py). This file owns the other three:
- chunk: grpo.prompts_per_step consecutive prompts of the one global order of training prompts
  (PromptOrder: a seeded permutation per epoch); chunk c holds prompts c*P .. c*P+P-1. Chunks are
  consumed in order, each once, on every rank alike; a chunk's episodes sample with keys from its
  index, so a chunk is the same work whenever it is decoded.
- rank share: a rank's part of a chunk, every world-th prompt of it with a group of episodes each
  (Chunk holds this rank's share). Its episodes are the synchronous step's peak batch.
- round: one next_round call: the next chunk, this rank's share decoded to its last episode and
  rewarded. A step takes one round and, with dynamic sampling, refill rounds (train.collect).
Engine steps, decode steps, optimizer steps and env steps are other units, always named in full.

k = 0 (synchronous, the default): a round starts its rank share's episodes in one engine.add on a
reset engine and decodes until the last one ends; nothing is decoded between steps. This is the
synchronous step, engine call for engine call.

k >= 1: the sampler keeps decoding across step boundaries. The open episodes are held to one rank
share's episodes (the synchronous step's peak batch); whenever a group's worth of them have ended,
the next group in the order is started, from the chunks up to k past the step's first. So the
rows a synchronous step leaves idle while its last, longest episodes finish now decode the next
steps' episodes, and the next step finds its chunk largely done. A round still waits for its own
chunk's last episode (a step trains whole groups, a chunk in order).
- Weight sync: train.py refreshes the sampler's weights in place after the update; episodes in flight
  continue on the new weights, their KV cache kept (PipelineRL), or recomputed from their ids by the
  current weights before the next token when stream.recompute_kv (NeMo-RL's switch).
- Versions: every sampled token records the step whose weights sampled it (Engine.version; the
  trainer at step s holds version s). A chunk started at version v has index at most c_v + k (c_v:
  step v's first chunk), or it is a refill round of step v itself; each step consumes at least one
  chunk, so c_{v+k} >= c_v + k and the chunk is trained at step v + k at the latest: no trained
  token is more than k steps old, by construction (step_metrics logs the staleness).
- The loss then holds three policies: the sampler's recorded logprobs are the behaviour policy, the
  trainer's old logprobs the proximal one; grpo.py's rollout correction weighs between them, and
  reads each token's age (its step minus its version: Trajectory.token_ages, LossInputs.ages).
- Another user of the engine (the evals: rollout() resets it) pauses the stream: at its next round
  the stream resets the engine and recomputes the KV of the episodes in flight from their ids, by
  the same weights (an eval runs after the sync); their tool calls keep running in the background.
- A checkpoint holds the chunks not yet consumed: every episode's ids, logprobs, versions and env
  steps, and the tool calls in flight with the clock they are due at (state_dict). A resume
  recomputes their KV from the ids, as a pause does.

Tests: .venv/bin/pytest tests/test_stream.py
Benchmark: bench/sync_vs_stream.py (synchronous against streaming, interleaved in one process)
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

import torch

from engine.scheduler import Sequence
from rollout import (Episode, EpisodeLoop, Trajectory, episode_stopper, max_turns, reward_episodes, start_episodes,
                     worst_case)
from sqltask import dataset
from trainer.config_loader import ConfigError
from trainer.distributed import all_max, all_sum

# -----------------------------------------------------------------------------
# the order of the training prompts


class PromptOrder:
    """The global order of training prompts: seeded epochs, a cursor saved in checkpoints."""

    def __init__(self, n: int, seed: int, cursor: int = 0):
        self.n, self.seed, self.cursor = n, seed, cursor
        self._epoch, self._perm = -1, []

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.cursor, self.n)
            if epoch != self._epoch:  # each epoch's order is a function of (seed, epoch) alone
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g).tolist()
            out.append(self._perm[pos])
            self.cursor += 1
        return out


@dataclass
class Chunk:
    """This rank's share of one chunk: its examples and their episodes, group-major (example i's
    group at i*G .. i*G+G-1), started a whole group at a time, in order."""
    index: int  # chunk c holds prompts c*P .. c*P+P-1 of the global order
    prompts: list[int]  # this rank's share of them (indices into the training examples)
    examples: list[dict]
    trajs: list[Trajectory]
    dbs: list[str]
    started: int = 0  # episodes started so far
    ended: int = 0  # ... and ended


# -----------------------------------------------------------------------------
# the stream


class RolloutStream:
    """This rank's stream: the prompt order, the chunks made and not yet trained, and one episode
    loop on the sampler's engine, kept across steps (module docstring)."""

    def __init__(self, sampler, tokenizer, examples: list[dict], cfg, rank: int, world: int, cursor: int = 0):
        """sampler: trainer.policy_sampler's (its engine is the stream's); examples: the training
        records; cursor: the prompt order's position (a checkpoint's)."""
        self.sampler, self.tokenizer, self.examples, self.cfg = sampler, tokenizer, examples, cfg
        self.rank, self.world, self.k = rank, world, cfg.stream.sampling_steps_ahead
        self.group_size, self.chunk_prompts = cfg.grpo.group_size, cfg.grpo.prompts_per_step
        self.share_episodes = -(-self.chunk_prompts // world) * self.group_size  # a rank share's: the most open
        self.order = PromptOrder(len(examples), cfg.train.seed, cursor)
        self.consumed = cursor // self.chunk_prompts  # the next chunk a round delivers
        self.chunks: deque[Chunk] = deque()  # made, not yet consumed, in order
        self.stopper = episode_stopper(tokenizer, cfg.env, sampler.model.config.vocab_size)
        self.loop = EpisodeLoop(sampler.engine, tokenizer, cfg.env)
        self.chunk_of: dict[int, Chunk] = {}  # an open episode's sequence index -> its chunk
        self.next_seq = 0  # sequence indices, unique within the loop
        self.step, self.step_chunk = -1, self.consumed  # the step being collected and its first chunk
        self.engine_resets = -1  # the engine's reset count after the stream's own last reset
        self.decode_steps = self.live_row_steps = 0  # this step's decode steps and rows decoded over them

    def close(self) -> None:
        self.loop.close()

    @property
    def cursor(self) -> int:
        """Prompts of the global order taken so far (chunks made, consumed or not)."""
        return self.order.cursor

    # -------------------------------------------------------------------------
    # one round: the next chunk, decoded to its last episode, rewarded

    def next_round(self, step: int, phase=None, first_group: int = 0) -> list[Episode]:
        """One round: this rank's share of the next chunk, every episode ended and rewarded
        (rollout.Episode, group first_group + i for its example i). A step's first round starts the
        step: its version (the weights the sampler holds) and, for k >= 1, the chunks it may start ahead."""
        phase = phase or (lambda name: contextlib.nullcontext())
        new_step = step != self.step
        if new_step:
            self.step, self.step_chunk = step, self.consumed
            self.decode_steps = self.live_row_steps = 0
        with phase("rollout"):
            chunk = self._chunk(self.consumed)
            self._take_engine(new_step, chunk)
            self._start(chunk.index)
            while chunk.ended < len(chunk.trajs):
                if not self.loop.busy():
                    raise RuntimeError(f"stream: chunk {chunk.index} has {len(chunk.trajs) - chunk.ended} episodes "
                                       "open, none of them in the engine")
                self._advance()
                self._start(chunk.index)
        assert self.chunks[0] is chunk
        self.chunks.popleft()
        self.consumed += 1
        with phase("reward"):
            return reward_episodes(chunk.trajs, chunk.examples, self.tokenizer, self.cfg, n=self.group_size,
                                   first_group=first_group)

    def _chunk(self, index: int) -> Chunk:
        """Chunk `index`, made (with every chunk before it) if not yet."""
        while not self.chunks or self.chunks[-1].index < index:
            self._make_chunk()
        return next(c for c in self.chunks if c.index == index)

    def _make_chunk(self) -> Chunk:
        index = self.order.cursor // self.chunk_prompts
        prompts = self.order.take(self.chunk_prompts)[self.rank::self.world]
        examples = [self.examples[i] for i in prompts]
        cfg = self.cfg
        # chunk c's seed is the synchronous loop's for step c's first round (chunk c is step c's when no
        # step took refill rounds): the same keys, so the same samples, as the step always had
        seed = (cfg.train.seed * 1_000_003 + index * 1009 + self.rank) % (2 ** 31)
        trajs, dbs = start_episodes(self.tokenizer, examples, cfg.env, cfg.data, cfg.data.db_root,
                                    n=self.group_size, seed=seed, first=self.next_seq)
        self.next_seq += len(trajs)
        chunk = Chunk(index, prompts, examples, trajs, dbs)
        self.chunks.append(chunk)
        return chunk

    def _take_engine(self, new_step: bool, chunk: Chunk) -> None:
        """Make the sampler's engine the stream's for this round. An idle stream resets it (as
        rollout() does before every rollout); one with episodes in flight keeps it, unless another
        run used it since (an eval) or the step's new weights should recompute their KV
        (stream.recompute_kv): then it resets and recomputes them from their ids (Engine.readmit)."""
        engine = self.sampler.engine
        in_flight = [t for t, _ in self.loop.open.values()]
        recompute = in_flight and (engine.resets != self.engine_resets or (new_step and self.cfg.stream.recompute_kv))
        if not in_flight or recompute:
            worst = [worst_case(t, self.cfg.env, self.cfg.sampling) for t in in_flight + chunk.trajs]
            engine.reset(self.stopper, worst_case=worst, greedy=False, logits_hook=None, cfg=self.cfg.sampling,
                         rows_in_place=self.k > 0)  # k >= 1: rows join and leave every step
            engine.readmit([t.seq for t in in_flight])
            self.engine_resets = engine.resets
        engine.version = self.step  # the weights the sampler holds: the trainer's at this step

    def _start(self, round_chunk: int) -> None:
        """Start the next groups in order while the open episodes leave room for a whole group (at
        most one rank share's episodes open), from the chunks this round may start: its own, and
        up to k past the step's first."""
        last = max(round_chunk, self.step_chunk + self.k)
        trajs, dbs, room = [], [], self.share_episodes - len(self.loop.open)
        for chunk in self._startable(last):
            while chunk.started < len(chunk.trajs) and room >= self.group_size:
                group = slice(chunk.started, chunk.started + self.group_size)
                trajs += chunk.trajs[group]
                dbs += chunk.dbs[group]
                for t in chunk.trajs[group]:
                    self.chunk_of[t.seq.index] = chunk
                chunk.started += self.group_size
                room -= self.group_size
            if chunk.started < len(chunk.trajs):
                break  # in order: a later chunk waits for this one's groups
        if trajs:
            for t in self.loop.add(trajs, dbs):  # one add: a prompt's G samples share its prefill
                self.chunk_of.pop(t.seq.index).ended += 1

    def _startable(self, last: int):
        """The chunks up to index `last` in order, made as they are reached."""
        i = 0
        while True:
            if i == len(self.chunks):
                if self.order.cursor // self.chunk_prompts > last:
                    return
                self._make_chunk()
            yield self.chunks[i]
            i += 1

    def _advance(self) -> None:
        """One iteration of the episode loop; counts the decode steps and the rows they decoded."""
        stats = self.sampler.engine.stats
        steps, rows = stats["decode_steps"], stats["live_rows"]
        for t in self.loop.advance():
            self.chunk_of.pop(t.seq.index).ended += 1
        self.decode_steps += stats["decode_steps"] - steps
        self.live_row_steps += stats["live_rows"] - rows

    # -------------------------------------------------------------------------
    # what a step logs of the stream

    def step_metrics(self, trained: list[Trajectory], step: int, device) -> dict:
        """The step's tail and staleness, reduced over ranks (a collective: every rank calls it).
        live_row_frac: rows decoded per decode step over the open-episode cap (a rank share's
        episodes, the synchronous peak); decode_steps_per_episode: decode steps of this step's
        rounds per trained episode; staleness_mean / _max: each trained token's age
        (Trajectory.token_ages: the steps between the weights that sampled it and the step training
        it), the maximum over every rank's tokens; stale_token_frac: the fraction of trained tokens
        sampled by older weights."""
        ages = [age for t in trained for age in t.token_ages(step)]
        steps, rows, episodes, age_sum, stale, tokens = all_sum(
            [self.decode_steps, self.live_row_steps, len(trained), sum(ages), sum(a > 0 for a in ages), len(ages)],
            device)
        return {"live_row_frac": rows / max(steps * self.share_episodes, 1),
                "decode_steps_per_episode": steps / max(episodes, 1),
                "staleness_mean": age_sum / max(tokens, 1),
                "staleness_max": float(all_max(max(ages, default=0), device)),
                "stale_token_frac": stale / max(tokens, 1)}

    # -------------------------------------------------------------------------
    # checkpoints: the chunks made and not consumed, their episodes in flight

    def state_dict(self) -> dict:
        """This rank's stream as plain data (a checkpoint's trainer.pt loads it with weights_only):
        the prompt order's cursor, the loop's clock, every chunk not yet consumed with each episode's
        tokens and state (episode_state), and the tool calls in flight (the clock they are due at, the
        episodes in them). Synchronous (k = 0): no chunk is open between steps, so only the cursor."""
        return {"cursor": self.order.cursor, "consumed": self.consumed, "clock": self.loop.clock,
                "next_seq": self.next_seq,
                "chunks": [{"index": c.index, "prompts": c.prompts, "started": c.started,
                            "episodes": [episode_state(t) for t in c.trajs]} for c in self.chunks],
                "tools": [[due, [t.seq.index for t in trajs]] for due, trajs, _ in self.loop.tools.pending]}

    def load_state_dict(self, states: list[dict] | None, cursor: int) -> None:
        """Continue from a checkpoint: states, every rank's state_dict() in rank order (None: a
        checkpoint from before streaming, which holds the cursor alone). This rank's chunks come back
        with their episodes, the episodes in flight rejoin the loop (their KV is recomputed from their
        ids at the next round: Engine.readmit) and the tool calls in flight run again (the env is
        deterministic), due at the same clock. Episodes in flight belong to their rank: a checkpoint
        holding some resumes on as many ranks only (ConfigError otherwise)."""
        if states is None or (len(states) != self.world and not any(s["chunks"] for s in states)):
            self.order = PromptOrder(len(self.examples), self.cfg.train.seed, cursor)  # nothing in flight
            self.consumed = self.step_chunk = cursor // self.chunk_prompts
            return
        if len(states) != self.world:
            raise ConfigError(f"the checkpoint holds episodes in flight on {len(states)} ranks "
                              f"(stream.sampling_steps_ahead): resume it on {len(states)} ranks, not {self.world}")
        self._load(states[self.rank])

    def _load(self, state: dict) -> None:
        cfg, self.chunks, self.chunk_of = self.cfg, deque(), {}
        self.order = PromptOrder(len(self.examples), cfg.train.seed, state["cursor"])
        self.consumed, self.step_chunk, self.next_seq = state["consumed"], state["consumed"], state["next_seq"]
        self.loop.clock = state["clock"]
        by_seq = {}
        for saved in state["chunks"]:
            examples = [self.examples[i] for i in saved["prompts"]]
            trajs = [restore_episode(e) for e in saved["episodes"]]
            dbs = [dataset.abs_db_path(examples[t.index], cfg.data.db_root) for t in trajs]
            chunk = Chunk(saved["index"], saved["prompts"], examples, trajs, dbs, started=saved["started"],
                          ended=sum(bool(t.end_reason) for t in trajs))
            self.chunks.append(chunk)
            for t, db in zip(trajs, dbs):
                by_seq[t.seq.index] = (t, db)
                if t.seq.status in ("waiting", "running", "paused"):  # started, not ended
                    self.loop.open[t.seq.index] = (t, db)
                    self.chunk_of[t.seq.index] = chunk
        for due, indices in state["tools"]:  # submitted at due - overlap: due at the same clock
            items = [by_seq[i] for i in indices]
            self.loop.tools.submit(due - cfg.env.tool_overlap_steps, [
                (t, db, self.tokenizer.decode(t.ids[t.seq.turn_start:]), max_turns(cfg.env) - t.seq.num_turns)
                for t, db in items])
        self.engine_resets = -1  # the next round resets the engine and recomputes the episodes in flight


EPISODE_FIELDS = ("turn_spans", "num_turns", "num_tool_calls", "final_sql", "end_reason", "finished", "text", "steps",
                  "index", "sample")
SEQUENCE_FIELDS = ("ids", "key", "index", "loss_mask", "logprobs", "versions", "turn_start", "num_turns", "budget",
                   "stop_reason", "status")


def episode_state(t: Trajectory) -> dict:
    """One episode as plain data: its Trajectory's fields and its engine Sequence's token state."""
    return {"prompt_len": len(t.prompt_ids), **{f: getattr(t, f) for f in EPISODE_FIELDS},
            "seq": {f: getattr(t.seq, f) for f in SEQUENCE_FIELDS}}


def restore_episode(state: dict) -> Trajectory:
    """episode_state's inverse: the episode holds no KV blocks (the engine recomputes them)."""
    seq = Sequence(**state["seq"])
    episode = {f: state[f] for f in EPISODE_FIELDS}
    episode["turn_spans"] = [tuple(span) for span in episode["turn_spans"]]
    return Trajectory(list(seq.ids[:state["prompt_len"]]), seq, **episode)
