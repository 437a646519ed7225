"""Gold turns: what a perfect policy would write, turn by turn, in the run's protocol (the SFT warm
start's episodes: sft.gold_episodes plays them through the env with replay.replay, tokenized exactly
as a rollout appends them, so SFT and RL see the same tokens).

    tags     <think>{think}</think>\n<sql>{lookup}</sql> | (observation) |
             <think>{think}</think>\n<solution>{gold}</solution>
    actions  <action>DESCRIBE t</action> | (observation) | ... (each table the gold reads) |
             <action>QUERY {lookup}</action> | (observation) | <action>ANSWER {gold}</action>

Tool turns, in order: (actions only) DESCRIBE of every table the gold reads, in the order the
gold names them; the record's `first_lookup_sql` when non-empty (a natural lookup that finds no
rows: the episode shows the failure and the recovery); its `lookup_sql` when non-empty (the toy's
lookup whose observation shows the code the gold needs); without a lookup, with
`sft.with_tool_turn`, the gold itself as a check. An episode has at most `budget` generations:
tool turns that do not fit are left out, DESCRIBEs first (from the last), then the first lookup,
so the answer always fits. The tags protocol thinks before each turn (SkyRL's rule: every
</observation> is followed by <think>); the actions protocol needs no think. Each turn ends on its
protocol's stop string (the rollout stops there: no end-of-turn token after it).

    turns = gold_turns(example, cfg, db_path, budget=rollout.max_turns(cfg.env))
Tests: .venv/bin/pytest tests/test_sft.py
"""
from __future__ import annotations

import functools
import sqlite3

from sqltask import sandbox

# -----------------------------------------------------------------------------
# the gold episode's turns (text only)


@functools.lru_cache(maxsize=65536)
def tables_read(db_path: str, sql: str) -> tuple[str, ...]:
    """The tables a query reads, in the order the query first names them (SQLite's authorizer
    reports every table read while it compiles the query; nothing runs). Names as the database
    spells them. A query that does not compile raises ValueError naming it."""
    seen: list[str] = []

    def note(action, arg1, *_):
        if action == sqlite3.SQLITE_READ and arg1 and arg1 not in seen and not arg1.startswith("sqlite_"):
            seen.append(arg1)
        return sqlite3.SQLITE_OK

    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        con.set_authorizer(note)
        con.execute("EXPLAIN " + sandbox.trim_sql(sql))
    except sqlite3.Error as e:
        raise ValueError(f"gold query does not compile on {db_path}: {e}: {sql}") from None
    finally:
        con.close()
    words = [t.strip('"`[]').lower() for t in sandbox.sql_tokens(sql)]
    first = {name: words.index(name.lower()) if name.lower() in words else len(words) for name in seen}
    return tuple(sorted(seen, key=lambda name: first[name]))  # stable: the authorizer's order breaks ties


def gold_turns(example: dict, cfg, db_path: str, budget: int) -> list[str]:
    """The model-side text of each turn of a record's gold episode in cfg.env.protocol (see the
    module docstring; cfg: config.Config); the last one ends the episode. budget: the generations
    an episode may have (rollout.max_turns: env.max_turns or env.step_budget)."""
    protocol, gold = cfg.env.protocol, example["gold_sql"]
    lookups = [q for q in (example.get("first_lookup_sql") or "", example.get("lookup_sql") or "") if q]
    check = [gold] if not lookups and cfg.sft.with_tool_turn else []
    # (sql, rank): the tool turns' queries; a higher rank is left out first when turns run short
    queries = [(q, 1) for q in lookups[:-1]] + [(q, 0) for q in lookups[-1:] + check]
    if protocol == "tags":
        think = f"<think>{cfg.sft.think_text}</think>\n"
        tools = [(f"{think}<sql>{q}</sql>", rank) for q, rank in queries]
        final = f"{think}<solution>{gold}</solution>"
    else:
        assert protocol == "actions", protocol
        tables = tables_read(db_path, gold)
        tools = ([(f"<action>DESCRIBE {t}</action>", 2 + len(tables) - i) for i, t in enumerate(tables)]
                 + [(f"<action>QUERY {q}</action>", rank) for q, rank in queries])
        final = f"<action>ANSWER {gold}</action>"
    # keep the tool turns that fit (the answer takes one generation), dropping the highest rank first
    room = max(0, budget - 1)
    keep = sorted(range(len(tools)), key=lambda i: (tools[i][1], i))[:room]
    return [tools[i][0] for i in sorted(keep)] + [final]
