"""The env steps of ended turns, run in background threads while the engine keeps decoding: the
multi-turn loop (rollout.EpisodeLoop) submits the turns that ended at one engine step as one batch
and collects the batches that are due (env.tool_wait: fixed or async, below).

    tools = ToolCalls(env_cfg, env.step_batch)
    tools.submit(clock, [(episode, db_path, turn_text, turns_left), ...])
    for episode, step_result in tools.collect(clock, idle=not engine.busy()): ...

Tests: .venv/bin/pytest tests/test_rollout_share.py tests/test_stall.py
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait


class ToolCalls:
    """The env steps of ended turns, run in background threads while the engine keeps decoding.

    The rows whose turns end at one engine step are one batch (one env.step_batch call, so its
    queries run in parallel on the SQL pool). env.tool_wait says when a batch's rows come back:

    fixed  a batch submitted at engine step s is collected at step s + env_cfg.tool_overlap_steps,
           or as soon as the engine has nothing else to do; if it is not finished by then, the
           loop waits. Which rows return when, and so every batch the engine forms, never depends
           on timing: a seeded rollout is reproducible step for step.
    async  every finished batch is collected at the next step, whatever its age; the loop waits
           (for the first batch to finish) only when the engine has nothing else to do. A slow
           query holds only its own batch's rows; the others keep decoding and batches behind it
           run on other threads. Each row still samples the same tokens (the noise of a token
           depends on its row and position only); which steps the engine batches rows in depends
           on timing. Rows of a later batch that also run SQL still queue behind a slow query in
           the SQL pool (sandbox.SqlPool runs one call at a time on its workers).
    """

    def __init__(self, env_cfg, step_batch):
        """env_cfg: config.EnvConfig; step_batch(db_paths, texts, turns_left, env_cfg) -> [StepResult]:
        the env's batched step (env.step_batch), run in the background threads."""
        if env_cfg.tool_wait not in ("fixed", "async"):
            raise ValueError(f"env.tool_wait={env_cfg.tool_wait!r}: expected 'fixed' or 'async'")
        self.cfg, self.step_batch, self.pending = env_cfg, step_batch, deque()  # (due step, trajectories, future), submission order
        self.wait_async = env_cfg.tool_wait == "async"
        threads = env_cfg.tool_threads if self.wait_async else 1
        self.thread = ThreadPoolExecutor(threads, thread_name_prefix="tool-calls")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)

    def busy(self) -> bool:
        return bool(self.pending)

    def submit(self, step: int, items: list[tuple[object, str, str, int]]) -> None:
        """items: (episode, db path, the turn's text, generations left after it); step: the loop's clock."""
        if items:
            dbs, texts, left = zip(*[i[1:] for i in items])
            future = self.thread.submit(self.step_batch, list(dbs), list(texts), list(left), self.cfg)
            self.pending.append((step + self.cfg.tool_overlap_steps, [i[0] for i in items], future))

    def collect(self, step: int, idle: bool) -> list:
        """(trajectory, env.StepResult) of every batch due at this step: fixed, those submitted
        tool_overlap_steps ago (all of them when idle); async, those finished (when idle and none
        has finished, the first to finish)."""
        if self.wait_async:
            if idle and self.pending and not any(f.done() for _, _, f in self.pending):
                wait([f for _, _, f in self.pending], return_when=FIRST_COMPLETED)
            finished = [p[2].done() for p in self.pending]  # read once: a future may finish meanwhile
            due = [p for p, done in zip(self.pending, finished) if done]
            self.pending = deque(p for p, done in zip(self.pending, finished) if not done)
        else:
            due = []
            while self.pending and (idle or self.pending[0][0] <= step):
                due.append(self.pending.popleft())
        out = []
        for _, trajs, future in due:
            out += zip(trajs, future.result())
        return out
