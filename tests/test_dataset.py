"""sqltask/dataset.py: the canonical record, the loader's error report, the gold runner."""
import json
import sqlite3

import pytest

import config as C
from sqltask.dataset import (FIELDS, DatasetError, abs_db_path, database_problem, drop_failing_golds, gold_failures,
                     load_examples, make_record, read_jsonl, run_gold, write_jsonl)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "db").mkdir()
    con = sqlite3.connect(tmp_path / "db" / "a.sqlite")
    con.execute("CREATE TABLE t (x INTEGER)")
    con.execute("INSERT INTO t VALUES (1), (2)")
    con.commit()
    con.close()
    return tmp_path


def rec(i, db="db/a.sqlite", **kw):
    return {**make_record(f"r{i}", "test", "a", db, f"question {i}?", "SELECT x FROM t"), **kw}


def test_round_trip(root, tmp_path):
    recs = [rec(0), rec(1, evidence="x is a number", extra="kept")]
    assert write_jsonl(tmp_path / "d.jsonl", recs) == 2
    assert list(json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])) == list(FIELDS)
    out = load_examples(tmp_path / "d.jsonl", root)
    assert [r["id"] for r in out] == ["r0", "r1"] and out[1]["evidence"] == "x is a number"
    assert out[1]["extra"] == "kept"
    assert out[0]["db_file"] == str((root / "db/a.sqlite").resolve()) == abs_db_path(out[0], root)
    assert abs_db_path(rec(0), root) == out[0]["db_file"]
    assert len(load_examples(tmp_path / "d.jsonl", root, limit=1)) == 1
    assert read_jsonl(tmp_path / "d.jsonl")[0] == recs[0]


def test_make_record_normalises_whitespace():
    r = make_record(3, "s", "a", "p", "  How  many\nrows ? ", " SELECT 1 ", None)
    assert r["id"] == "3" and r["question"] == "How many rows ?" and r["gold_sql"] == "SELECT 1" and r["evidence"] == ""


def test_every_problem_reported_at_once(root, tmp_path):
    lines = [
        json.dumps(rec(0)),
        json.dumps({k: v for k, v in rec(1).items() if k not in ("gold_sql", "evidence")}),  # 2 missing fields
        "{not json",
        json.dumps(rec(3, db="db/missing1.sqlite")),
        json.dumps(rec(4, db="db/missing2.sqlite")),
        json.dumps(rec(5, db="db/missing2.sqlite")),
        json.dumps(rec(0)),  # duplicate id
        json.dumps({**rec(7), "question": 7}),  # not a string
        json.dumps([1, 2]),
    ]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as e:
        load_examples(tmp_path / "bad.jsonl", root)
    msg = str(e.value)
    f = tmp_path / "bad.jsonl"
    for part in [f"{f}:2: missing field(s) evidence, gold_sql", f"{f}:3: not valid JSON",
                 "missing1.sqlite: database not found (used by 1 record(s), first on " + f"{f}:4",
                 "missing2.sqlite: database not found (used by 2 record(s), first on " + f"{f}:5",
                 f"{f}:7: duplicate id 'r0'", f"{f}:8: field(s) question must be strings",
                 f"{f}:9: expected a JSON object", f"7 problems in {f}:"]:
        assert part in msg, (part, msg)
    assert len(msg.splitlines()) == 8  # a header, then each problem on one line


def test_missing_file_and_empty(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_examples(tmp_path / "nope.jsonl", tmp_path)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no records"):
        load_examples(tmp_path / "e.jsonl", tmp_path)


def test_run_gold(root):
    db = root / "db/a.sqlite"
    assert run_gold(db, "SELECT x FROM t") == ""
    assert "no such table" in run_gold(db, "SELECT * FROM nope")
    endless = "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c) SELECT COUNT(*) FROM c"
    assert run_gold(db, endless, timeout_s=0.2).startswith("timeout")
    assert run_gold(db, "DELETE FROM t") != ""  # read-only
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM t").fetchone()[0] == 2
    assert run_gold(root / "nope.sqlite", "SELECT 1").startswith("cannot open")


def test_unusable_databases_are_named_at_load(root, tmp_path):
    """A 0-byte database opens as an empty one (an empty schema in the prompt, its 60 questions
    always wrong, exit 0); a corrupt one was a sqlite3 traceback naming no file at the first rollout.
    Each is named once at load, with its record count and first line, beside the other problems."""
    (root / "db" / "empty.sqlite").write_bytes(b"")
    (root / "db" / "corrupt.sqlite").write_bytes(b"this is not SQLite" * 100)
    sqlite3.connect(root / "db" / "no_tables.sqlite").execute("PRAGMA user_version = 1").connection.close()
    (root / "db" / "folder.sqlite").mkdir()
    recs = [rec(0), rec(1, db="db/empty.sqlite"), rec(2, db="db/empty.sqlite"), rec(3, db="db/corrupt.sqlite"),
            rec(4, db="db/no_tables.sqlite"), rec(5, db="db/folder.sqlite")]
    write_jsonl(tmp_path / "d.jsonl", recs)
    with pytest.raises(DatasetError) as e:
        load_examples(tmp_path / "d.jsonl", root)
    msg, f = str(e.value), tmp_path / "d.jsonl"
    for part in [f"empty.sqlite: the database is an empty file (0 bytes) (used by 2 record(s), first on {f}:2",
                 f"corrupt.sqlite: not a readable SQLite database (file is not a database) (used by 1 record(s), "
                 f"first on {f}:4", "no_tables.sqlite: the database has no tables", "folder.sqlite: not a database file",
                 f"4 problems in {f}:"]:
        assert part in msg, (part, msg)
    assert database_problem(root / "db" / "a.sqlite") == ""
    assert database_problem(root / "db" / "nope.sqlite") == "database not found"


def test_failing_golds_are_found_as_the_reward_runs_them(root, tmp_path):
    """A gold that fails on its database can never be matched: every answer to its question scores
    0. gold_failures runs each one through exec_match.match_batch (the sandbox; spider mode's rewriting)."""
    write_jsonl(tmp_path / "d.jsonl", [rec(0), rec(1, gold_sql="SELECT y FROM t"), rec(2, gold_sql="SELECT * FROM nope"),
                                       rec(3, gold_sql="DELETE FROM t")])
    exs = load_examples(tmp_path / "d.jsonl", root)
    errors = gold_failures(exs, C.RewardConfig())
    assert errors[0] == "" and "no such column: y" in errors[1] and "no such table: nope" in errors[2]
    assert errors[3] != ""  # read-only sandbox: a gold that writes fails too
    assert gold_failures(exs[:1], C.RewardConfig(mode="spider")) == [""]
    kept, note = drop_failing_golds(exs, errors, "train")
    assert [r["id"] for r in kept] == ["r0"]
    assert note.startswith(f"train: skipped 3 of 4 examples whose gold query fails on its database: {tmp_path}/d.jsonl:2: ")
    assert drop_failing_golds(exs[:1], errors[:1], "train") == (exs[:1], "")
    with pytest.raises(DatasetError, match=r"train: every gold query \(3\) fails on its database"):
        drop_failing_golds(exs[1:], errors[1:], "train")
