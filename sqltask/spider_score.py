"""Execution accuracy of a predictions file against Spider-format gold (`python eval.py score`).

    gold = read_gold("dev_gold.sql")                        # [(SQL, db_id)], from 'SQL<TAB>db_id' lines
    recs = score(pred_lines, gold, "DIR/database", "spider") # per example: exec_match, skipped, error
    agree, n, differ = compare_verdicts(recs, "official.verdicts.jsonl")

Databases are <db_root>/<db_id>/<db_id>.sqlite; a missing one is skipped and counted. In spider
mode each prediction line goes through the official evaluation.py's input handling
(official_pred_text: stripped, cut at its first TAB, " value " -> " 1 "). The verdicts are
exec_match.match_batch's, run in the read-only sandbox. A database present but unusable (empty,
not SQLite, unreadable, no tables: unusable_databases) skips its examples, named in the summary line.

Agreement with the official test-suite evaluator (taoyds/test-suite-sql-eval, exec match, default
settings): 972/972 per-example verdicts on the published Spider predictions tests/test_eval_score.py
reads (spider_preds/ beside the Spider folder). Deliberate differences, none of which occurs in those files:
- queries run in the read-only sandbox (sqltask/sandbox.py): a prediction that writes, attaches, etc. is an
  error (the official script executes it against the database file);
- each query has a timeout (--timeout, 30 s; the official one cannot interrupt a query), SQL text
  is capped at 100 KB and results at 1e6 rows / 64 MB;
- invalid UTF-8 in the database is decoded with replacement (official: dropped); both sides are
  decoded the same way, so verdicts differ only if two texts differ by invalid bytes alone;
- a blank prediction line is an empty (wrong) prediction at its position (the official script
  treats blank lines as separators between interaction sessions).
Tests: .venv/bin/pytest tests/test_eval_score.py
"""
from __future__ import annotations

import json
import os

from sqltask import dataset, exec_match

def read_gold(path: str) -> list[tuple[str, str]]:
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            sql, sep, db_id = line.strip().rpartition("\t")
            if not sep:
                raise SystemExit(f"{path}:{n}: expected 'SQL<TAB>db_id', got {line.strip()[:80]!r}")
            out.append((sql, db_id.strip()))
    return out


def official_pred_text(line: str) -> str:
    """The official evaluation.py's input handling of one prediction line."""
    return line.strip().split("\t")[0].replace(" value ", " 1 ")


def score(pred_lines: list[str], gold: list[tuple[str, str]], db_root: str, mode: str = "spider", *,
          timeout_s: float = 30.0, keep_distinct: bool = False, workers: int = 0) -> list[dict]:
    """Per-example verdicts, in order. A blank prediction line is an (empty, wrong) prediction:
    lines are matched by position (the official script would instead treat it as a separator)."""
    if len(pred_lines) != len(gold):
        raise SystemExit(f"{len(pred_lines)} predictions for {len(gold)} gold lines")
    recs, items, where = [], [], []
    for i, (line, (g_sql, db_id)) in enumerate(zip(pred_lines, gold)):
        db = os.path.join(db_root, db_id, db_id + ".sqlite")
        rec = {"index": i, "db_id": db_id, "exec_match": False, "skipped": not os.path.isfile(db), "error": None}
        recs.append(rec)
        if not rec["skipped"]:
            pred = official_pred_text(line) if mode == "spider" else line.strip()
            items.append((db, pred, g_sql))
            where.append(i)
    verdicts = exec_match.match_batch(items, mode, timeout_s=timeout_s, keep_distinct=keep_distinct, workers=workers)
    for i, (ok, err) in zip(where, verdicts):
        recs[i]["exec_match"], recs[i]["error"] = ok, (err or None)
    return recs


def compare_verdicts(recs: list[dict], path: str) -> tuple[int, int, list[int]]:
    """(agree, total compared, indices that differ) against an official verdicts file."""
    official = {}
    with open(path) as fh:
        for line in fh:
            v = json.loads(line)
            official[v["index"]] = v
    diff, n = [], 0
    for r in recs:
        v = official.get(r["index"])
        if v is None or v.get("skipped") or r["skipped"]:
            continue
        n += 1
        if bool(v["exec_match"]) != r["exec_match"]:
            diff.append(r["index"])
    return n - len(diff), n, diff


def unusable_databases(recs: list[dict], db_root: str) -> dict[str, str]:
    """{db_id: what is wrong} for the databases present but not usable: an empty (0-byte) file, not
    a SQLite file, unreadable, no tables. Their examples would all score wrong for a reason that is
    no prediction's fault; `score` skips them and says why in its summary line."""
    out = {}
    for db_id in sorted({r["db_id"] for r in recs if not r["skipped"]}):
        if problem := dataset.database_problem(os.path.join(db_root, db_id, db_id + ".sqlite")):
            out[db_id] = problem
    return out
