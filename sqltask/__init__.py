"""The SQL task's plumbing, used by env.py, reward.py, rollout.py and eval.py (it imports nothing from the
top-level files).

    sandbox.py       sandboxed SQLite: hardened read-only connections in a killable worker-process pool
    dataset.py       the canonical jsonl record and its loader (every line, database and gold checked)
    prompts.py       schema DDL and the prompt templates (chat messages of an example)
    spider_score.py  Spider's execution-match rule on a predictions file, per-example verdicts
"""
