"""The random policy: what it writes, turn by turn (the floor under "did it learn?": eval.random_floor
plays these turns through the real env with replay.replay and scores them with the same reward as
any rollout, so the number compares with held-out EX).

Each episode draws its actions at random from the protocol instead of a model: a random number of
tool calls (random SELECTs over the database's real tables and columns; in the actions protocol
also DESCRIBE / SAMPLE of a random table), then a random answer of the same kind, every turn well
formed (the floor measures content, not format). Seeded: the same (examples, seed) give the same turns.

    db_paths, turns = random_turns(examples, cfg.env, cfg.data.db_root, seed=0, samples=1)
Tests: .venv/bin/pytest tests/test_baseline.py
"""
from __future__ import annotations

import random

from sqltask import dataset, prompts

AGGREGATES = ("COUNT", "MIN", "MAX", "AVG", "SUM")

# -----------------------------------------------------------------------------
# random actions


def random_select(tables, rng: random.Random) -> str:
    """One random single-table SELECT over the schema (tables: prompts.read_schema's)."""
    if not tables:
        return "SELECT 1"
    t = rng.choice(tables)
    col = prompts.quote(rng.choice(t.columns).name) if t.columns else "*"
    shape = rng.randrange(5)
    if shape == 0:
        return f"SELECT * FROM {prompts.quote(t.name)} LIMIT {rng.randint(1, 5)}"
    if shape == 1:
        return f"SELECT {col} FROM {prompts.quote(t.name)}"
    if shape == 2:
        return f"SELECT DISTINCT {col} FROM {prompts.quote(t.name)}"
    if shape == 3:
        return f"SELECT COUNT(*) FROM {prompts.quote(t.name)}"
    return f"SELECT {rng.choice(AGGREGATES)}({col}) FROM {prompts.quote(t.name)}"


def random_tool_turn(tables, protocol: str, rng: random.Random) -> str:
    """The text of one random tool call, written as the model would write it."""
    if protocol == "tags":
        return f"<think>A random query.</think>\n<sql>{random_select(tables, rng)}</sql>"
    kind = rng.choice(("DESCRIBE", "SAMPLE", "QUERY"))
    if kind == "QUERY" or not tables:
        return f"<action>QUERY {random_select(tables, rng)}</action>"
    return f"<action>{kind} {rng.choice(tables).name}</action>"


def random_answer(tables, protocol: str, rng: random.Random) -> str:
    """The text of one random final answer (well formed: the floor measures content, not format)."""
    sql = random_select(tables, rng)
    if protocol == "tags":
        return f"<think>A random answer.</think>\n<solution>{sql}</solution>"
    return f"<action>ANSWER {sql}</action>"


# -----------------------------------------------------------------------------
# episodes


def random_turns(examples: list[dict], env_cfg, db_root, *, seed: int, samples: int = 1) -> tuple[list[str], list]:
    """(db paths, turn texts) of samples random episodes per example (example-major, like a rollout):
    0 .. env.max_turns - 1 tool calls, then an answer. One random stream per episode, drawn in
    order: the number of tool calls, each tool turn, the answer. env_cfg: config.EnvConfig."""
    dbs, turns = [], []
    for i, ex in enumerate(examples):
        db = dataset.abs_db_path(ex, db_root)
        tables = list(prompts.read_schema(db))
        for j in range(samples):
            rng = random.Random(seed * 1_000_003 + i * 1009 + j)  # one stream per episode
            n_tools = rng.randint(0, max(0, env_cfg.max_turns - 1))
            said = [random_tool_turn(tables, env_cfg.protocol, rng) for _ in range(n_tools)]
            dbs.append(db)
            turns.append(said + [random_answer(tables, env_cfg.protocol, rng)])
    return dbs, turns
