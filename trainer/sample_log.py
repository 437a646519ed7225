"""Sampled training episodes where people look for them: <out_dir>/samples.jsonl and a wandb.Table.

Every `train.sample_every` steps train.py hands the step's sampled episodes (before the
dynamic-sampling filter) to SampleLog.write. It keeps up to `train.sample_rows` of them, the first
sample of each prompt (different questions), appends one JSON line per episode to
<out_dir>/samples.jsonl and, with wandb on, logs the table `samples` holding every row written so
far (the wandb UI shows a table's latest version, so the newest one holds the whole run).

A row: {"step", "question", "turns": [{"sql", "observation", "text"}, ...], "solution", "reward",
"exec_match", "gold"}: each turn's query (the action's argument: the SQL of a tool call or of the
solution; "" when the turn parsed to no action), the observation the env appended after it ("" on
the last turn) and the model's raw text.

    .venv/bin/python -m pytest -q tests/test_samples.py
"""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ["step", "question", "turns", "solution", "reward", "exec_match", "gold"]

# -----------------------------------------------------------------------------
# rows


def episode_row(step: int, episode, tokenizer) -> dict:
    """One sampled episode (rollout.Episode) as a row."""
    traj, rw, example = episode.trajectory, episode.reward, episode.example
    turns = []
    for k, turn in enumerate(traj.turn_texts(tokenizer)):
        # env steps run one per turn, in order; a turn the episode ended on without one has none
        sql = traj.steps[k]["arg"] if k < len(traj.steps) else ""
        turns.append({"sql": sql, "observation": turn["observation"].strip(), "text": turn["text"]})
    return {"step": step, "question": example["question"], "turns": turns,
            "solution": traj.final_sql if traj.finished else "", "reward": float(rw.value),
            "exec_match": bool(rw.exec_match), "gold": example["gold_sql"]}


def pick(n_episodes: int, group_size: int, rows: int) -> list[int]:
    """Indices of the first sample of each prompt (episodes come G per prompt), at most `rows`."""
    return list(range(0, n_episodes, max(1, group_size)))[:rows]


def turns_text(turns: list[dict]) -> str:
    """The turns as one readable cell of the wandb table."""
    return "\n".join(f"{k + 1}. {t['sql'] or t['text']}" + (f"\n   -> {t['observation']}" if t["observation"] else "")
                     for k, t in enumerate(turns))


# -----------------------------------------------------------------------------
# the log


class SampleLog:
    """Appends rows to <out_dir>/samples.jsonl and, when run (a wandb run) is given, logs them as the
    wandb.Table `samples` (cumulative)."""

    def __init__(self, out_dir: str, run=None):
        self.path, self.run, self.table_rows = Path(out_dir) / "samples.jsonl", run, []

    def write(self, step: int, episodes, tokenizer, group_size: int, rows: int) -> list[dict]:
        """Rows of up to `rows` episodes (rollout.Episode list, G per prompt in a row), appended."""
        out = [episode_row(step, episodes[i], tokenizer) for i in pick(len(episodes), group_size, rows)]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            for r in out:
                fh.write(json.dumps(r) + "\n")
        if self.run is not None:
            import wandb
            self.table_rows += [[r["step"], r["question"], turns_text(r["turns"]), r["solution"], r["reward"],
                                 r["exec_match"], r["gold"]] for r in out]
            self.run.log({"samples": wandb.Table(columns=COLUMNS, data=self.table_rows)}, step=step)
        return out
