"""The SQL tool as the model sees it: the two dialogue protocols (SkyRL tags, sql_env actions),
observations, and one environment step for a batch of rows. Execution is sqltask/sandbox.py's (hardened
read-only SQLite in a killable worker pool); run_sql, run_sql_batch and SqlResult are re-exported.

    python env.py DB.sqlite "SELECT ..."     # run one query through the sandbox, print the observation

API: parse_turn -> Action; step_batch -> StepResult; format_observation; table_names_text;
step_record; STOP_STRINGS (for the sampler); run_sql / run_sql_batch -> SqlResult (sqltask/sandbox.py).
Tests: .venv/bin/pytest tests/test_env.py
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqltask.prompts import read_schema, render_table
from sqltask.sandbox import SqlResult, run_sql, run_sql_batch  # noqa: F401 (re-exported: the tool's API in one place)

if TYPE_CHECKING:  # keep the import light (config pulls in yaml)
    from config import EnvConfig

# -----------------------------------------------------------------------------
# protocols: parse one model turn

STOP_STRINGS = {"tags": ["</sql>", "</solution>"], "actions": ["</action>"]}


@dataclass
class Action:
    kind: str  # "sql" | "solution" | "invalid" (tags); "describe" | "sample" | "query" | "answer" (actions)
    arg: str = ""  # the SQL, or the table name


def _block(text: str, tag: str) -> str | None:
    """Content of the first closed <tag>…</tag>; with repeated openings the last one before the
    closing counts (`<sql><sql>X</sql>` -> X); a stray closing before is ignored. Linear time."""
    start = text.find(f"<{tag}>")
    close = text.find(f"</{tag}>", start) if start >= 0 else -1
    if close < 0:
        return None
    start = text.rfind(f"<{tag}>", start, close)
    return text[start + len(tag) + 2:close]


_FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n?(.*?)(?:```|\Z)", re.S)


def clean_sql(sql: str) -> str:
    """Strip whitespace and a ```sql fence the model put inside the tag."""
    m = _FENCE.search(sql)
    return (m.group(1) if m else sql).strip()


_ACTION = re.compile(r"\s*(DESCRIBE|SAMPLE|QUERY|ANSWER)\b[\s:]*(.*)", re.I | re.S)


def parse_turn(text: str, protocol: str = "tags") -> Action:
    """One model turn -> Action. Tags: a closed <solution> ends the episode (SkyRL checks it
    first); else the first closed <sql> is a tool call; else invalid. Actions: the first closed
    <action>KIND arg</action>."""
    if protocol == "tags":
        sol = _block(text, "solution")
        if sol is not None:
            return Action("solution", clean_sql(sol))
        sql = _block(text, "sql")
        return Action("invalid") if sql is None else Action("sql", clean_sql(sql))
    assert protocol == "actions", protocol
    body = _block(text, "action")
    m = _ACTION.match(body) if body is not None else None
    if m is None:
        return Action("invalid")
    kind, arg = m.group(1).lower(), m.group(2)
    arg = clean_sql(arg) if kind in ("query", "answer") else arg.strip().strip("`'\"[];").strip()
    return Action(kind, arg)


# -----------------------------------------------------------------------------
# observations


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes):
        return "x'" + v[:32].hex() + ("…'" if len(v) > 32 else "'")
    return str(v).replace("\n", " ")


def format_table(result: SqlResult, max_chars: int, max_rows: int, row_cap: int = 0, note: str = "") -> str:
    """Columns then rows, ' | ' separated. Longer than max_chars -> the first max_rows rows with
    `note`; still too long -> cut at max_chars. row_cap > 0 always cuts to that many rows."""
    rows, total = result.rows, len(result.rows)
    more = " or more" if result.truncated else ""
    notes = []
    if row_cap and total > row_cap:
        rows = rows[:row_cap]
        notes.append(f"Showing the first {row_cap} of {total}{more} rows.")
    lines, size = [" | ".join(result.columns)], 0
    for r in rows:  # stop building as soon as the text is known to be too long
        lines.append(" | ".join(map(_cell, r)))
        size += len(lines[-1]) + 1
        if size > max_chars:
            break
    text = "\n".join(lines)
    if len(text) > max_chars:
        text = "\n".join(lines[:max_rows + 1])
        notes.append(note.format(shown=min(max_rows, len(rows)), total=f"{total}{more}"))
        if len(text) > max_chars:
            text = text[:max_chars] + "…"
            notes.append(f"(cut at {max_chars} characters)")
    elif result.truncated and not notes:
        notes.append(f"Only the first {total} rows were fetched.")
    if not result.rows:
        notes.append("(0 rows)")
    return "\n".join(notes[:1] + [text] + notes[1:]) if notes else text


def format_observation(result: SqlResult, turns_left: int, cfg: EnvConfig, row_cap: int = 0) -> str:
    """SkyRL-SQL's observation text (the strings are cfg's): the result as a table, cut to
    max_result_rows rows with a note past max_obs_chars; the error or timeout text otherwise."""
    if result.timed_out:
        body = cfg.timeout_text
    elif not result.ok:
        body = cfg.error_text.format(error=result.error)
    else:
        body = format_table(result, cfg.max_obs_chars, cfg.max_result_rows, row_cap, cfg.truncated_text)
    return cfg.obs_template.format(result=body, turns_left=turns_left)


# -----------------------------------------------------------------------------
# one environment step for a batch of rows (all SQL of the batch runs together in the pool)

_TABLES: dict[str, list[str]] = {}  # db_path -> table names (actions protocol), cached per run
_TABLES_SQL = "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' ORDER BY name"


def table_names(db_paths, workers: int = 0) -> dict[str, list[str]]:
    missing = sorted({str(p) for p in db_paths} - set(_TABLES))
    for p, r in zip(missing, run_sql_batch([(p, _TABLES_SQL) for p in missing], workers=workers)):
        _TABLES[p] = [row[0] for row in r.rows] if r.ok else []
    return {str(p): _TABLES[str(p)] for p in db_paths}


def table_names_text(db_path) -> str:
    """The schema shown in the actions protocol: table names only."""
    return "Tables: " + ", ".join(table_names([db_path])[str(db_path)])


@dataclass
class StepResult:
    action: Action
    observation: str  # "" when done
    done: bool
    result: SqlResult | None = None


def _quote_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def step_batch(db_paths: list, texts: list[str], turns_left: list[int], cfg: EnvConfig) -> list[StepResult]:
    """Parse each row's turn, run every tool call of the batch in one pool call, format the
    observations. turns_left[i]: generations row i has after this one; at 0 a non-final turn ends
    the episode without an answer (no observation). A final answer is not executed here."""
    actions = [parse_turn(t, cfg.protocol) for t in texts]
    tables = table_names(db_paths, cfg.workers) if cfg.protocol == "actions" else {}
    out: list = [None] * len(texts)
    jobs, owners = [], []
    for i, a in enumerate(actions):
        if a.kind in ("solution", "answer") or turns_left[i] <= 0:
            out[i] = StepResult(a, "", True)
        elif a.kind == "invalid":
            out[i] = StepResult(a, cfg.obs_template.format(result=cfg.invalid_text, turns_left=turns_left[i]), False)
        elif a.kind in ("describe", "sample"):
            names = {t.lower(): t for t in tables[str(db_paths[i])]}
            name = names.get(a.arg.lower())
            if name is None:
                msg = f"Error: no table named '{a.arg}'. Tables: {', '.join(names.values())}"
                out[i] = StepResult(a, cfg.obs_template.format(result=msg, turns_left=turns_left[i]), False)
                continue
            q = (f"SELECT sql FROM sqlite_master WHERE type='table' AND name='{name.replace(chr(39), chr(39) * 2)}'"
                 if a.kind == "describe" else f"SELECT * FROM {_quote_name(name)} LIMIT {cfg.sample_rows}")
            jobs.append((db_paths[i], q)), owners.append(i)
        else:  # "sql" / "query"
            jobs.append((db_paths[i], a.arg)), owners.append(i)
    results = run_sql_batch(jobs, timeout_s=cfg.tool_timeout_s, max_rows=cfg.fetch_rows, workers=cfg.workers)
    for i, r in zip(owners, results):
        a = actions[i]
        if a.kind == "describe" and r.ok and r.rows:
            text = r.rows[0][0] if cfg.describe == "ddl" else describe_columns(db_paths[i], a.arg)
            obs = cfg.obs_template.format(result=text, turns_left=turns_left[i])
        else:
            cap = cfg.actions_max_result_rows if a.kind == "query" else 0
            obs = format_observation(r, turns_left[i], cfg, row_cap=cap)
        out[i] = StepResult(a, obs, False, r)
    return out


def describe_columns(db_path, name: str) -> str:
    """DESCRIBE with env.describe=columns: the table's columns, types and keys on one line
    (sqltask/prompts.py's typed rendering of the schema it reads and caches per file)."""
    table = next(t for t in read_schema(db_path) if t.name.lower() == name.lower())
    return render_table(table, "typed")


def step_record(step: StepResult) -> dict:
    """One env step as Trajectory.steps keeps it: what reward.py's dense shaping needs (actions
    protocol), first_query_bad's row count (any protocol) and the observation's text (the turn
    credit of grpo.lookup_bonus reads it; "" when the step ended the episode)."""
    r = step.result
    return {"kind": step.action.kind, "arg": step.action.arg, "ok": bool(r and r.ok),
            "rows": list(r.rows) if (r and r.ok and step.action.kind == "query") else None,
            "n_rows": len(r.rows) if (r and r.ok) else None,  # the error-recovery rate's
            "observation": step.observation}


def first_query_bad(steps: list[dict]) -> bool:
    """Did the episode's first SQL tool call (`<sql>` or the actions protocol's QUERY; DESCRIBE and
    SAMPLE are not queries) fail, time out or return no rows? steps: step_record dicts. An episode
    with a bad first query that still ends right is a recovery (the evals' error-recovery rate)."""
    first = next((s for s in steps if s["kind"] in ("sql", "query")), None)
    return first is not None and (not first["ok"] or first["n_rows"] == 0)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    res = run_sql(sys.argv[1], sys.argv[2])
    print(res.error or f"{len(res.rows)} rows in {res.elapsed_s * 1000:.2f} ms")
    from config import EnvConfig
    print(format_observation(res, 5, EnvConfig()))
