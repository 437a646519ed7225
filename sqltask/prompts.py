"""Schema text and prompt templates: what the model sees before its first turn.

    python -m sqltask.prompts DB.sqlite [--samples 3] [--max-tokens 500]     # print a schema and what was cut
    python -m sqltask.prompts --jsonl FILE --db-root DIR [--template compact] [--protocol tags] [-n 1]

- schema_ddl(db_file, ...) -> (CREATE TABLE text, info): read from the database itself (sqlite_master
  + PRAGMA table_info / foreign_key_list), types, primary and foreign keys, optionally OmniSQL-style
  `-- example: [...]` values per column, under a token budget. Over budget it drops sample values
  first, then columns (never keys, never the first) of the tables least connected to the others by foreign keys, then
  whole tables; `info` says exactly what went, and the schema text marks cut tables.
- build_messages(example, db_root, cfg, protocol) -> chat messages, by DataConfig.prompt_template:
  "skyrl" (SkyRL-SQL's system text + DDL user message, for instruct models) or "compact" (one line
  per table, for the tiny model). The actions protocol (sql_env) shows table names only.
All template text lives in the TEMPLATE TEXT section below.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sqlite3
import time
import types
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

# -----------------------------------------------------------------------------
# TEMPLATE TEXT (every string the model reads, in one place)

SKYRL_SYSTEM = """You are a data science expert. You are given a database schema and a natural language question. Your task is to understand the schema and write one valid SQLite query that answers the question, within a limited number of turns. Break the problem down, reason about it, check your ideas with the SQL tool, and then give the final query.

Database engine: SQLite

Instructions:
- Return only the information the question asks for: if it asks for a column, select that column and nothing more.
- The query must return all of the information asked for, with nothing missing and nothing extra.
- Before the final query, think through the steps: analyse the question, summarise what you found, check the current step, fix errors, decide which SQL to run next.

Format:
- Think inside <think>...</think> every time you get new information.
- To explore or check, write one SQL query inside <sql>...</sql>. Its result comes back inside <observation>...</observation> (long results are truncated to 50 rows). Then think again and refine.
- When no more exploration is needed, or you are out of turns, give the final SQL query inside <solution>...</solution>. This ends the task.

------------------------ START OF EXAMPLE ------------------------
Question: how many pigs are in the farm?
Database Schema:
CREATE TABLE animals (
  id INTEGER,
  species TEXT,
  age INTEGER,
  name TEXT,
  PRIMARY KEY (id)
);

<think>I need the number of rows of animals whose species is pig. Let me check how species are written.</think>
<sql>SELECT COUNT(*) FROM animals WHERE species = 'pig'</sql>

<observation>COUNT(*)
12
<reminder>You have 4 turns left to complete the task.</reminder></observation>

<think>There are 12 pigs. The query answers the question.</think>
<solution>SELECT COUNT(*) FROM animals WHERE species = 'pig'</solution>
------------------------ END OF EXAMPLE ------------------------"""

SKYRL_USER = """Database Schema:
{schema}
This schema describes the database: its tables, columns, primary keys, foreign keys and relationships.

External Knowledge:
{evidence}

Question:
{question}"""

# kept to a few tokens: the tiny model learns the protocol from the SFT warm start, and every
# prompt token costs compute on a 2-core CPU
COMPACT_SYSTEM = "Text to SQLite."
COMPACT_USER = "{schema}\n{evidence}Question: {question}"
COMPACT_EVIDENCE = "Hint: {evidence}\n"

ACTIONS_SYSTEM = """You answer questions about a SQLite database by exploring it step by step. Only the table names are shown; find out the rest with actions. Each turn, think briefly, then write exactly one action inside <action>...</action>:
- <action>DESCRIBE table</action>: the columns and types of a table.
- <action>SAMPLE table</action>: a few rows of a table.
- <action>QUERY sql</action>: run a read-only SELECT query (results cut to 20 rows).
- <action>ANSWER sql</action>: your final SQL query; this ends the episode.
You have a limited number of steps: answer before they run out.
Example:
<action>DESCRIBE animals</action>
<action>QUERY SELECT COUNT(*) FROM animals WHERE species = 'pig'</action>
<action>ANSWER SELECT COUNT(*) FROM animals WHERE species = 'pig'</action>"""
COMPACT_ACTIONS_SYSTEM = ("Explore the database with one action per turn: <action>DESCRIBE table</action>, "
                          "<action>SAMPLE table</action>, <action>QUERY sql</action>; finish with "
                          "<action>ANSWER sql</action>.")
ACTIONS_USER = "Tables: {tables}\n{evidence}Question: {question}"

TRUNCATED_NOTE = "  -- {n} more column(s) not shown"  # inside a cut CREATE TABLE
DROPPED_TABLES_NOTE = "-- {n} more table(s) not shown: {names}"


def approx_tokens(text: str) -> int:
    """Default token counter: ~4 characters per token (pass a real tokenizer's for exact budgets)."""
    return (len(text) + 3) // 4


# -----------------------------------------------------------------------------
# reading a schema (trusted metadata: a plain read-only connection, cached per file)


@dataclass
class Column:
    name: str
    type: str
    samples: list = field(default_factory=list)


@dataclass
class Table:
    name: str
    columns: list[Column]
    pk: list[str]  # primary key columns, in key order
    fks: list[tuple[list[str], str, list[str]]]  # (columns, referenced table, referenced columns)


def quote(name: str) -> str:
    """Identifiers that need it get double quotes (Spider has spaces, dashes, keywords)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and name.upper() not in _KEYWORDS:
        return name
    return '"' + name.replace('"', '""') + '"'


_KEYWORDS = {"ORDER", "GROUP", "SELECT", "FROM", "WHERE", "TABLE", "INDEX", "KEY", "PRIMARY", "FOREIGN",
             "REFERENCES", "DEFAULT", "CHECK", "LIMIT", "VALUES", "TO", "AS", "IN", "IS", "BY", "ON", "AND",
             "OR", "NOT", "NULL", "JOIN", "UNION", "CASE", "WHEN", "THEN", "ELSE", "END", "TRANSACTION"}


def _sample(con, table: str, col: str, n: int) -> list:
    """Up to n distinct non-NULL values (DISTINCT + LIMIT stops early on big tables); long text cut."""
    try:
        rows = con.execute(f"SELECT DISTINCT {quote(col)} FROM {quote(table)} "
                           f"WHERE {quote(col)} IS NOT NULL LIMIT {int(n)}").fetchall()
    except sqlite3.Error:  # e.g. interrupted by the deadline below, or an odd legacy table
        return []
    out = []
    for (v,) in rows:
        if isinstance(v, bytes):
            continue  # blobs say nothing useful in a prompt
        if isinstance(v, str) and ("\n" in v or "\r" in v):
            v = " ".join(v.split())  # a newline would end the `-- example:` comment
        if isinstance(v, str) and len(v) > 40:
            v = v[:40] + "..."
        out.append(v)
    return out


@functools.lru_cache(maxsize=512)
def _read_schema(db_file: str, mtime_ns: int, sample_values: int) -> tuple[Table, ...]:
    con = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    deadline = time.monotonic() + 10.0  # sample queries on a huge database must not hang a run
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 10000)
    try:
        names = [r[0] for r in con.execute(
            "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
        tables = []
        for t in names:
            info = con.execute(f"PRAGMA table_info({quote(t)})").fetchall()  # cid, name, type, notnull, dflt, pk
            cols = [Column(r[1], (r[2] or "").strip()) for r in info]
            pk = [r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
            fks: dict[int, tuple] = {}
            for r in con.execute(f"PRAGMA foreign_key_list({quote(t)})"):  # id, seq, table, from, to, ...
                src, ref, dst = fks.setdefault(r[0], ([], r[2], []))
                src.append(r[3])
                dst.append(r[4] or "")  # `to` is NULL when the reference is to the primary key
            if sample_values > 0:
                for c in cols:
                    c.samples = _sample(con, t, c.name, sample_values)
            # SQLite numbers foreign keys last-declared first: list them in declaration order
            tables.append(Table(t, cols, pk, [fks[k] for k in sorted(fks, reverse=True)]))
        return tuple(tables)
    finally:
        con.close()


def read_schema(db_file, sample_values: int = 0) -> tuple[Table, ...]:
    """Tables of a database, cached per (file, mtime, sample_values). Do not mutate the result."""
    db_file = os.path.realpath(db_file)
    if not os.path.isfile(db_file):
        raise FileNotFoundError(f"database not found: {db_file}")
    return _read_schema(db_file, os.stat(db_file).st_mtime_ns, sample_values)


# -----------------------------------------------------------------------------
# rendering under a budget


def _fmt_value(v) -> str:
    return "'" + v.replace("'", "''") + "'" if isinstance(v, str) else repr(v)


def render_table(t: Table, style: str, keep: set | None = None, samples: bool = True) -> str:
    """One table: style ddl (CREATE TABLE), compact (names only) or typed (names, types and keys on one
    line: the actions protocol's DESCRIBE with env.describe=columns). keep: the column names to show
    (None = all); hidden ones are announced (ddl, compact)."""
    cols = [c for c in t.columns if keep is None or c.name in keep]
    hidden = len(t.columns) - len(cols)
    if style == "compact":  # customers(id, name, city)
        more = f", ... +{hidden}" if hidden else ""
        return f"{t.name}({', '.join(c.name for c in cols)}{more})"
    tail = []
    if t.pk:
        tail.append(f"PRIMARY KEY ({', '.join(map(quote, t.pk))})")
    for src, ref, dst in t.fks:
        to = f" ({', '.join(map(quote, dst))})" if all(dst) else ""
        tail.append(f"FOREIGN KEY ({', '.join(map(quote, src))}) REFERENCES {quote(ref)}{to}")
    if style == "typed":  # customers(id INTEGER, name TEXT; PRIMARY KEY (id)): the DDL's facts on one line
        typed = ", ".join(f"{quote(c.name)}{' ' + c.type if c.type else ''}" for c in cols)
        return f"{quote(t.name)}({typed}{'; ' if tail else ''}{'; '.join(tail)})"
    lines = []
    for i, c in enumerate(cols):
        comma = "," if i < len(cols) - 1 or tail else ""
        line = f"  {quote(c.name)}{' ' + c.type if c.type else ''}{comma}"
        if samples and c.samples:
            line += f" -- example: [{', '.join(_fmt_value(v) for v in c.samples)}]"
        lines.append(line)
    if hidden:
        lines.append(TRUNCATED_NOTE.format(n=hidden))
    lines += [f"  {x}{',' if i < len(tail) - 1 else ''}" for i, x in enumerate(tail)]
    return f"CREATE TABLE {quote(t.name)} (\n" + "\n".join(lines) + "\n);"


def drop_order(tables) -> list[Table]:
    """Tables least connected to the others first: closeness = sum of 1/distance over the
    undirected foreign-key graph (an isolated table scores 0); ties: more columns first, then name."""
    by = {t.name.lower(): t for t in tables}
    adj = {k: set() for k in by}
    for t in tables:
        for _, ref, _ in t.fks:
            if ref.lower() in by and ref.lower() != t.name.lower():
                adj[t.name.lower()].add(ref.lower())
                adj[ref.lower()].add(t.name.lower())
    score = {}
    for k in by:
        dist, todo = {k: 0}, deque([k])
        while todo:
            u = todo.popleft()
            for v in adj[u] - dist.keys():
                dist[v] = dist[u] + 1
                todo.append(v)
        score[k] = sum(1 / d for d in dist.values() if d)
    return sorted(tables, key=lambda t: (score[t.name.lower()], -len(t.columns), t.name))


def schema_text(db_file, style: str = "ddl", sample_values: int = 0, max_tokens=None, count_tokens=None):
    """(text, info) of a database's schema; see the module docstring. info: tokens, budget,
    truncated, dropped_samples, dropped_columns {table: [cols]}, dropped_tables [names].
    Cached per (file, mtime, arguments): rollouts render the same few schemas over and over."""
    db_file = os.path.realpath(db_file)
    if not os.path.isfile(db_file):
        raise FileNotFoundError(f"database not found: {db_file}")
    text, info = _schema_text(db_file, os.stat(db_file).st_mtime_ns, style, sample_values, max_tokens, count_tokens)
    return text, json.loads(json.dumps(info))  # a copy: callers may edit theirs


@functools.lru_cache(maxsize=1024)
def _schema_text(db_file, _mtime_ns, style, sample_values, max_tokens, count_tokens):
    count = count_tokens or approx_tokens
    tables = read_schema(db_file, sample_values if style == "ddl" else 0)
    keep = {t.name: [c.name for c in t.columns] for t in tables}
    shown = [t.name for t in tables]
    info = dict(tokens=0, budget=max_tokens, truncated=False, dropped_samples=False,
                dropped_columns={}, dropped_tables=[])
    sep = "\n\n" if style == "ddl" else "\n"

    def render():
        parts = [render_table(t, style, set(keep[t.name]), not info["dropped_samples"])
                 for t in tables if t.name in shown]
        if info["dropped_tables"]:
            parts.append(DROPPED_TABLES_NOTE.format(n=len(info["dropped_tables"]),
                                                    names=", ".join(info["dropped_tables"])))
        return sep.join(parts)

    text = render()
    info["tokens"] = count(text)
    if not max_tokens or info["tokens"] <= max_tokens:
        return text, info
    info["truncated"] = True
    if any(c.samples for t in tables for c in t.columns):  # 1. sample values go first
        info["dropped_samples"] = True
        text = render()
        info["tokens"] = count(text)
        if info["tokens"] <= max_tokens:
            return text, info
    order = drop_order(tables)
    saved = 0  # estimated tokens dropped since the last render: re-render only when it covers the excess
    for t in order:  # 2. non-key columns of the least connected tables, last column first
        keys = set(t.pk) | {c for src, _, _ in t.fks for c in src}
        # other tables' foreign keys may point at this table's columns: keep those too
        keys |= {d for u in tables for _, ref, dst in u.fks if ref.lower() == t.name.lower() for d in dst}
        keys = {k.lower() for k in keys} | {t.columns[0].name.lower()}  # never every column (tables go in 3.)
        for c in reversed(t.columns):
            if c.name.lower() in keys:  # SQLite names are case-insensitive; Spider's FKs mix cases
                continue
            keep[t.name].remove(c.name)
            info["dropped_columns"].setdefault(t.name, []).append(c.name)
            saved += count(f"  {c.name} {c.type},\n")
            if saved >= info["tokens"] - max_tokens:
                text, saved = render(), 0
                info["tokens"] = count(text)
                if info["tokens"] <= max_tokens:
                    return text, info
    text = render()
    info["tokens"] = count(text)
    for t in order[:-1]:  # 3. whole tables, but always leave one
        if info["tokens"] <= max_tokens:
            break
        shown.remove(t.name)
        info["dropped_tables"].append(t.name)
        text = render()
        info["tokens"] = count(text)
    return text, info


def schema_ddl(db_file, sample_values=0, max_tokens=None, count_tokens=None) -> tuple[str, dict]:
    """CREATE TABLE statements of a database (DEVELOPERS.md interface); see schema_text."""
    return schema_text(db_file, "ddl", sample_values, max_tokens, count_tokens)


# -----------------------------------------------------------------------------
# chat messages


def build_prompt(example: dict, db_root, cfg, protocol: str = "tags", count_tokens=None):
    """(messages, info) for one canonical record. cfg: config.DataConfig. info: schema_text's."""
    from sqltask import dataset
    db_file = dataset.abs_db_path(example, db_root)
    evidence = (example.get("evidence") or "").strip()
    q = example["question"]
    if protocol == "actions":  # sql_env: the schema is explored with actions, only names shown
        names = ", ".join(t.name for t in read_schema(db_file))
        ev = COMPACT_EVIDENCE.format(evidence=evidence) if evidence else ""
        system = COMPACT_ACTIONS_SYSTEM if cfg.prompt_template == "compact" else ACTIONS_SYSTEM
        return ([{"role": "system", "content": system},
                 {"role": "user", "content": ACTIONS_USER.format(tables=names, evidence=ev, question=q)}],
                dict(tokens=0, truncated=False))
    assert protocol == "tags", protocol
    if cfg.prompt_template == "compact":
        schema, info = schema_text(db_file, "compact", 0, cfg.schema_max_tokens, count_tokens)
        ev = COMPACT_EVIDENCE.format(evidence=evidence) if evidence else ""
        return ([{"role": "system", "content": COMPACT_SYSTEM},
                 {"role": "user", "content": COMPACT_USER.format(schema=schema, evidence=ev, question=q)}], info)
    assert cfg.prompt_template == "skyrl", cfg.prompt_template
    schema, info = schema_ddl(db_file, cfg.schema_sample_values, cfg.schema_max_tokens, count_tokens)
    user = SKYRL_USER.format(schema=schema, evidence=evidence, question=q)
    return [{"role": "system", "content": SKYRL_SYSTEM}, {"role": "user", "content": user}], info


_WARNED: set = set()


def build_messages(example: dict, db_root, cfg, protocol: str = "tags", count_tokens=None) -> list[dict]:
    """Chat messages [{"role", "content"}] for one record. A cut schema warns once per database
    (use build_prompt for the details)."""
    msgs, info = build_prompt(example, db_root, cfg, protocol, count_tokens)
    if info.get("truncated") and example["db_id"] not in _WARNED:
        _WARNED.add(example["db_id"])
        cut = {k: info[k] for k in ("dropped_samples", "dropped_columns", "dropped_tables") if info[k]}
        warnings.warn(f"schema of {example['db_id']} cut to {info['tokens']}/{info['budget']} tokens: {cut}")
    return msgs


# -----------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description="print a schema or rendered prompts")
    ap.add_argument("db", nargs="?")
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=0, help="schema budget (default: none; --jsonl: 4000)")
    ap.add_argument("--style", default="ddl", choices=["ddl", "compact"])
    ap.add_argument("--jsonl")
    ap.add_argument("--db-root", default=".")
    ap.add_argument("--template", default="skyrl", choices=["skyrl", "compact"])
    ap.add_argument("--protocol", default="tags", choices=["tags", "actions"])
    ap.add_argument("-n", type=int, default=1)
    a = ap.parse_args()
    if a.jsonl:  # build_prompt reads these three keys of config.DataConfig (4000: its default budget)
        cfg = types.SimpleNamespace(prompt_template=a.template, schema_sample_values=a.samples,
                                    schema_max_tokens=a.max_tokens or 4000)
        with open(a.jsonl) as fh:
            for line, _ in zip(fh, range(a.n)):
                msgs, info = build_prompt(json.loads(line), a.db_root, cfg, a.protocol)
                for m in msgs:
                    print(f"--- {m['role']}\n{m['content']}")
                print(f"--- info {info}\n")
    elif a.db:
        text, info = schema_text(a.db, a.style, a.samples, a.max_tokens or None)
        print(text)
        print(f"\n-- info: {info}")
    else:
        ap.error("give a database file or --jsonl")


if __name__ == "__main__":
    main()
