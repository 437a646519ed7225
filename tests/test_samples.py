"""Sampled episodes where people look for them: a short train.py run with wandb offline writes
<out_dir>/samples.jsonl and the wandb table `samples` with the same rows; the evals log error
recovery (first query failed or empty, recovered, recovery_rate) in metrics.jsonl.

    .venv/bin/python -m pytest -q tests/test_samples.py
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from conftest import ROOT, build_tiny_assets

import config as C
import eval as eval_
from trainer import run_log
from trainer import sample_log
from reward import Reward
from rollout import Episode


def test_samples_jsonl_and_offline_wandb_table_hold_the_same_episodes(tmp_path):
    settings = build_tiny_assets(tmp_path)
    home = tmp_path / "home"  # wandb writes nothing outside the test's folder
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline",
           "HOME": str(home), "WANDB_DIR": str(home), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_DATA_DIR": str(home / "data"), "WANDB_SILENT": "true"}
    out_dir = tmp_path / "run"
    args = ["configs/tiny.yaml", *("--" + s for s in settings), "--data.max_train_examples=64",
            "--data.max_eval_examples=4", "--grpo.prompts_per_step=4", "--grpo.group_size=2",
            "--sampling.max_new_tokens=16", "--grpo.dynamic_sampling=false", "--sft.steps=0",
            "--train.steps=2", "--train.eval_every=0", "--train.sample_every=1", "--train.sample_rows=3",
            "--train.threads=1", "--wandb.mode=offline", f"--train.out_dir={out_dir}"]
    p = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    rows = [json.loads(line) for line in open(out_dir / "samples.jsonl")]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]  # sample_rows per sample_every step
    golds = {}  # a question's golds (the same question asked on several databases)
    for line in open(tmp_path / "toy" / "train.jsonl"):
        rec = json.loads(line)
        golds.setdefault(rec["question"], set()).add(rec["gold_sql"])
    for r in rows:
        assert set(r) == {"step", "question", "turns", "solution", "reward", "exec_match", "gold"}
        assert r["gold"] in golds[r["question"]]  # the row's gold is its question's
        assert r["turns"] and all(set(t) == {"sql", "observation", "text"} for t in r["turns"])
        assert isinstance(r["reward"], float) and isinstance(r["exec_match"], bool)
    assert len({r["question"] for r in rows if r["step"] == 1}) == 3  # one sample per prompt
    # the offline run's table files: the newest holds every row so far, in the same order
    tables = sorted((out_dir / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"),
                    key=lambda f: int(f.name.split("_")[1]))  # samples_<step>_<hash>.table.json
    assert len(tables) == 2, list((out_dir / "wandb").rglob("*"))
    last = json.loads(tables[-1].read_text())
    assert last["columns"] == sample_log.COLUMNS
    assert [[d[0], d[1], d[3], d[4], d[5], d[6]] for d in last["data"]] == \
        [[r["step"], r["question"], r["solution"], r["reward"], r["exec_match"], r["gold"]] for r in rows]
    assert [d[2] for d in last["data"]] == [sample_log.turns_text(r["turns"]) for r in rows]


def _episode(first_rows, right):
    """A fake rollout episode whose first query returned first_rows rows (None: failed) and a reward."""
    step = {"kind": "sql", "arg": "SELECT 1", "ok": first_rows is not None, "rows": None, "n_rows": first_rows}
    traj = SimpleNamespace(steps=[step], num_turns=2, num_tool_calls=1, loss_mask=[1, 1], end_reason="answer", truncated=False)
    return Episode(traj, Reward(float(right), right, True), {}, 0)


def test_evaluate_logs_recovery_counts_and_rate(tmp_path, monkeypatch):
    """eval.evaluate logs eval.py generate's error recovery: first query failed or empty, of those
    the episodes that ended right, and their ratio (absent when no first query went wrong)."""
    cfg = C.load_config([f"--train.out_dir={tmp_path}", "--wandb.mode=disabled"])
    eps = [_episode(0, True), _episode(0, False), _episode(None, True), _episode(3, True), _episode(2, False)]
    monkeypatch.setattr(eval_, "sample_episodes", lambda *a, **k: list(eps))
    log = run_log.Log(cfg, 0)
    m = eval_.evaluate(None, None, list(range(5)), cfg, 0, 1, torch.device("cpu"), log, 4)
    assert (m["eval/first_query_bad"], m["eval/recovered"], m["eval/recovery_rate"]) == (3, 2, 2 / 3)
    eps[:] = [_episode(1, True)]
    m = eval_.evaluate(None, None, [0], cfg, 0, 1, torch.device("cpu"), log, 8)
    assert m["eval/first_query_bad"] == 0 and "eval/recovery_rate" not in m
    logged = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["eval/first_query_bad"], r.get("eval/recovery_rate")) for r in logged] == \
        [(4, 3, 2 / 3), (8, 0, None)]
