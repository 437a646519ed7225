"""The canonical example format of grpo-sql and its loader.

One jsonl line per question:

    {"id": "spider-dev-0", "source": "spider", "db_id": "concert_singer",
     "db_path": "database/concert_singer/concert_singer.sqlite",   # relative to a db_root
     "question": "How many singers do we have?", "evidence": "",     # evidence may be empty
     "gold_sql": "SELECT count(*) FROM singer"}

Every dataset (Spider, its variants, BIRD, SkyRL-SQL-653, the toy set) is converted to this by a
script in data/, so train.py and eval.py read one thing. The database root is given at run time
(DataConfig.db_root) so the same jsonl works wherever the databases live.

    python -m sqltask.dataset FILE.jsonl DB_ROOT      # validate a file, print counts per source / db
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote

FIELDS = ("id", "source", "db_id", "db_path", "question", "evidence", "gold_sql")


class DatasetError(ValueError):
    """A jsonl file that does not follow the canonical format; the message lists every problem."""


# -----------------------------------------------------------------------------
# writing


def make_record(id, source, db_id, db_path, question, gold_sql, evidence="") -> dict:
    """A canonical record with the fields in the canonical order (stable, diff-able jsonl)."""
    rec = dict(id=str(id), source=source, db_id=db_id, db_path=str(db_path),
               question=" ".join(str(question).split()), evidence=(evidence or "").strip(),
               gold_sql=str(gold_sql).strip())
    return {k: rec[k] for k in FIELDS}


def write_jsonl(path, records) -> int:
    """Write records atomically (temp file + rename: a crash never leaves half a file).
    Returns the number of lines written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: two writers never share it
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def read_jsonl(path) -> list[dict]:
    """Plain reader (no validation): used by scripts and tests."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run_gold(db_file, sql: str, timeout_s: float = 30.0) -> str:
    """Execute a gold query read-only (prepare scripts: does it run here?). "" if it ran, else the
    error ("timeout after Ns" when the progress-handler deadline hit). Rows are streamed, not kept."""
    try:
        con = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    except sqlite3.Error as e:
        return f"cannot open database: {e}"
    deadline = time.monotonic() + timeout_s
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        for _ in con.execute(sql):
            pass
        return ""
    except sqlite3.OperationalError as e:
        return f"timeout after {timeout_s:g}s" if time.monotonic() > deadline else f"{type(e).__name__}: {e}"
    except (sqlite3.Error, ValueError) as e:  # ValueError: e.g. NUL characters in the text
        return f"{type(e).__name__}: {e}"
    finally:
        con.close()


def _run_gold_job(job):
    return run_gold(*job)


def run_golds(jobs: list[tuple], timeout_s: float = 30.0, workers: int = 0) -> list[str]:
    """run_gold over [(db_file, sql)], in order; a process pool when there are many (BIRD's golds
    can take seconds each). workers: 0 = all cores, 1 = in this process."""
    workers = workers or os.cpu_count() or 1
    jobs = [(str(f), sql, timeout_s) for f, sql in jobs]
    if workers == 1 or len(jobs) < 200:
        return [run_gold(*j) for j in jobs]
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(workers) as ex:
        return list(ex.map(_run_gold_job, jobs, chunksize=16))


# -----------------------------------------------------------------------------
# loading with validation


def abs_db_path(example: dict, db_root) -> str:
    """The database file of a record: its `db_file` (set by load_examples) or db_root/db_path,
    absolute. The one place a record's database path is resolved (prompts, rewards, SFT, eval)."""
    return example.get("db_file") or str((Path(db_root) / example["db_path"]).resolve())


def fit_prompts(examples: list[dict], prompt_lengths: list[int], max_prompt_tokens: int,
                max_context: int) -> tuple[list[dict], int]:
    """Keep the examples whose rendered prompt has at most max_prompt_tokens tokens and leaves
    room for at least one generated token in max_context (a longer one could only give an empty
    episode). -> (kept examples in order, number dropped)."""
    limit = min(max_prompt_tokens, max_context - 1)
    kept = [ex for ex, n in zip(examples, prompt_lengths, strict=True) if n <= limit]
    return kept, len(examples) - len(kept)


def database_problem(db_file) -> str:
    """'' for a readable SQLite database with at least one table, else what is wrong with it. A
    0-byte file opens as an empty database (SQLite creates nothing read-only): every question on
    it would see an empty schema and score 0, so it is a problem here, not at the first rollout."""
    try:
        size = os.path.getsize(db_file)
    except FileNotFoundError:
        return "database not found"
    except OSError as e:
        return f"cannot read the database: {e.strerror}"
    if not os.path.isfile(db_file):
        return "not a database file"
    if size == 0:
        return "the database is an empty file (0 bytes)"
    if not os.access(db_file, os.R_OK):
        return "the database is not readable (permissions)"
    try:
        con = sqlite3.connect(f"file:{quote(str(db_file))}?mode=ro", uri=True)
        try:
            n = con.execute("SELECT count(*) FROM sqlite_master WHERE type IN ('table', 'view')").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error as e:  # "file is not a database", "unable to open database file", ...
        return f"not a readable SQLite database ({e})"
    return "" if n else "the database has no tables"


def load_examples(path, db_root, limit=0) -> list[dict]:
    """Read and validate a canonical jsonl file; return its records (first `limit` if > 0).

    Each record gets two extra keys: `db_file`, the absolute database path (db_root/db_path), and
    `where`, "FILE:LINE" of its line (for messages). Keys beyond the canonical ones (e.g. the toy
    set's `template`) are kept as they are. Every problem is collected before raising, one line
    each naming the file and line, so one run shows all of them: unreadable lines, missing or
    non-string fields, duplicate ids, and each database that is missing, empty (0 bytes), not a
    readable SQLite file or without tables (once, with how many records use it).
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}" if not path.exists() else f"{path}: not a file")
    root = Path(db_root)
    problems: list[str] = []
    out: list[dict] = []
    seen: dict[str, int] = {}
    db_users: dict[str, list[int]] = {}  # database -> lines of the records on it (checked once each)
    try:
        fh = open(path, encoding="utf-8")
        lines = list(enumerate(fh, 1))
        fh.close()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read it ({e})") from None
    for lineno, line in lines:
        at = f"{path}:{lineno}"
        if not line.strip():
            continue
        if limit and len(out) >= limit:
            break
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{at}: not valid JSON ({e.msg})")
            continue
        if not isinstance(rec, dict):
            problems.append(f"{at}: expected a JSON object, got {type(rec).__name__}")
            continue
        absent = [f for f in FIELDS if f not in rec]
        wrong = [f for f in FIELDS if f in rec and not isinstance(rec[f], str)]
        empty = [f for f in ("id", "db_path", "question", "gold_sql")
                 if isinstance(rec.get(f), str) and not rec[f].strip()]
        if absent:
            problems.append(f"{at}: missing field(s) {', '.join(absent)}")
        if wrong:
            problems.append(f"{at}: field(s) {', '.join(wrong)} must be strings")
        if empty:
            problems.append(f"{at}: empty field(s) {', '.join(empty)}")
        if absent or wrong or empty:
            continue
        if rec["id"] in seen:
            problems.append(f"{at}: duplicate id {rec['id']!r} (first on line {seen[rec['id']]})")
        seen[rec["id"]] = lineno
        db_file = abs_db_path(rec, root)
        db_users.setdefault(db_file, []).append(lineno)
        out.append({**rec, "db_file": db_file, "where": at})
    for db_file, users in db_users.items():
        if bad := database_problem(db_file):
            problems.append(f"{db_file}: {bad} (used by {len(users)} record(s), first on {path}:{users[0]}; "
                            f"db_root={root})")
    if problems:
        shown = problems[:50] + ([f"... and {len(problems) - 50} more"] if len(problems) > 50 else [])
        raise DatasetError(shown[0] if len(problems) == 1 else
                           "\n  ".join([f"{len(problems)} problems in {path}:"] + shown))
    if not out:
        raise DatasetError(f"{path}: no records")
    return out


def gold_failures(examples: list[dict], reward_cfg) -> list[str]:
    """Run every record's gold query on its database exactly as the reward will (exec_match.match_batch:
    the sandbox, reward.mode's rewriting, reward.timeout_s; the results stay in its gold cache) ->
    per record "" or the error. A gold that fails would make every answer to its question wrong.
    Over ranks: trainer.distributed.map_shared (each rank runs a share)."""
    from sqltask import exec_match
    verdicts = exec_match.match_batch([(ex["db_file"], "", ex["gold_sql"]) for ex in examples], reward_cfg.mode,
                                      timeout_s=reward_cfg.timeout_s, keep_distinct=reward_cfg.keep_distinct)
    prefix = "gold failed: "  # match_batch's text for a gold that did not run
    return [err[len(prefix):] if err.startswith(prefix) else "" for _, err in verdicts]


def drop_failing_golds(examples: list[dict], errors: list[str], name: str) -> tuple[list[dict], str]:
    """(records whose gold runs, a note naming the ones skipped: "" if none). Every gold failing
    is a DatasetError (no reward could ever be earned)."""
    bad = [(ex, err) for ex, err in zip(examples, errors, strict=True) if err]
    if not bad:
        return examples, ""
    shown = "; ".join(f"{ex.get('where', ex['id'])}: {err}" for ex, err in bad[:3]) + (" ..." if len(bad) > 3 else "")
    if len(bad) == len(examples):
        raise DatasetError(f"{name}: every gold query ({len(bad)}) fails on its database: {shown}")
    kept = [ex for ex, err in zip(examples, errors) if not err]
    return kept, f"{name}: skipped {len(bad)} of {len(examples)} examples whose gold query fails on its database: {shown}"


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m sqltask.dataset FILE.jsonl DB_ROOT")
    try:
        ex = load_examples(sys.argv[1], sys.argv[2])
    except DatasetError as e:
        sys.exit(f"error: {e}")
    print(f"{len(ex)} records ok")
    for k in ("source", "db_id"):
        c = Counter(r[k] for r in ex)
        print(f"  {k}: {len(c)} distinct; top: {', '.join(f'{a}={n}' for a, n in c.most_common(8))}")
