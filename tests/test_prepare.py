"""data/prepare_*.py: Spider (real data when present, else skipped), its variants, BIRD and
SkyRL-SQL on small fixtures written here."""
import json
import sqlite3
import subprocess
import sys

import pytest

from conftest import HAVE_SPIDER, ROOT, SPIDER, SPIDER_MISSING
from sqltask.dataset import load_examples, read_jsonl

sys.path.insert(0, str(ROOT / "data"))
import prepare_skyrl  # noqa: E402


def run(script, *args):
    p = subprocess.run([sys.executable, str(ROOT / "data" / script), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout


def make_db(path, n=3):
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT)")
    con.executemany("INSERT INTO t VALUES (?, ?)", [(i, f"n{i}") for i in range(n)])
    con.commit()
    con.close()


ENDLESS = "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c) SELECT COUNT(*) FROM c"


# -----------------------------------------------------------------------------
# Spider


@pytest.mark.skipif(not HAVE_SPIDER, reason=SPIDER_MISSING)
def test_spider_real_data(tmp_path):
    out = run("prepare_spider.py", "--src", SPIDER, "--out", tmp_path, "--variant", "all")
    assert "dev           972 records    62 skipped (62 database missing)" in out, out
    assert "train        6901 records    99 skipped (96 database missing, 3 gold fails)" in out, out
    want = {"dev": 972, "train": 6901, "realistic": 476, "syn": 972, "dk": 472}
    for name, n in want.items():
        recs = load_examples(tmp_path / f"{name}.jsonl", SPIDER)  # one db_root serves every set
        assert len(recs) == n, name
    sk = read_jsonl(tmp_path / "skipped.jsonl")
    assert {s["db_id"] for s in sk if s["split"] == "dev"} == {"wta_1"}
    assert {s["db_id"] for s in sk if s["reason"].startswith("database missing") and s["split"] == "train"} == \
        {"baseball_1", "soccer_1"}
    assert sorted(s["id"] for s in sk if s["reason"].startswith("gold fails")) == \
        ["spider-train-3153", "spider-train-4513", "spider-train-4514"]
    assert [s["id"] for s in read_jsonl(tmp_path / "skipped_dk.jsonl") if "gold" in s["reason"]] == ["spider-dk-76"]
    dk = load_examples(tmp_path / "dk.jsonl", SPIDER)
    assert sum(r["db_id"].startswith("new_") for r in dk) == 126
    syn = read_jsonl(tmp_path / "syn.jsonl")
    src = json.loads((SPIDER.parent / "spider_variants/spider_syn/dev.json").read_text())
    assert syn[0]["question"] == " ".join(src[0]["SpiderSynQuestion"].split())
    dev = read_jsonl(tmp_path / "dev.jsonl")
    assert dev[0] == {"id": "spider-dev-0", "source": "spider", "db_id": "concert_singer",
                      "db_path": "database/concert_singer/concert_singer.sqlite",
                      "question": "How many singers do we have?", "evidence": "", "gold_sql": "SELECT count(*) FROM singer"}
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    run("prepare_spider.py", "--src", SPIDER, "--out", tmp_path, "--variant", "dk")  # idempotent
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_spider_fixture_json_train(tmp_path):
    src = tmp_path / "spider"
    make_db(src / "database/a/a.sqlite")
    rows = [{"db_id": "a", "question": "How many?", "query": "SELECT count(*) FROM t"},
            {"db_id": "a", "question": "Broken", "query": "SELECT nope FROM t"},
            {"db_id": "gone", "question": "Where?", "query": "SELECT 1"},
            {"db_id": "a", "question": "Slow", "query": ENDLESS}]
    (src / "dev.json").write_text(json.dumps(rows[:1]))
    (src / "train_spider.json").write_text(json.dumps(rows))
    out = run("prepare_spider.py", "--src", src, "--out", tmp_path / "o", "--timeout", "0.3")
    assert "train           1 records     3 skipped" in out, out
    sk = {s["id"]: s["reason"] for s in read_jsonl(tmp_path / "o/skipped.jsonl")}
    assert sk["spider-train-1"].startswith("gold fails: OperationalError: no such column")
    assert sk["spider-train-2"] == "database missing: gone"
    assert sk["spider-train-3"].startswith("gold fails: timeout")
    assert len(load_examples(tmp_path / "o/dev.jsonl", src)) == 1


# -----------------------------------------------------------------------------
# BIRD


def test_bird_fixture(tmp_path):
    src = tmp_path / "bird"
    make_db(src / "dev_databases/x/x.sqlite")
    make_db(src / "train/train_databases/y/y.sqlite")
    dev = [{"question_id": 0, "db_id": "x", "question": "Names?", "evidence": "name refers to t.name",
            "SQL": "SELECT name FROM t", "difficulty": "simple"},
           {"question_id": 1, "db_id": "x", "question": "Slow?", "evidence": "", "SQL": ENDLESS},
           {"question_id": 2, "db_id": "nope", "question": "Gone?", "evidence": "", "SQL": "SELECT 1"}]
    (src / "dev.json").write_text(json.dumps(dev))
    (src / "train/train.json").write_text(json.dumps([{"db_id": "y", "question": "Q?", "evidence": "e",
                                                        "SQL": "SELECT id FROM t"}]))
    out = run("prepare_bird.py", "--src", src, "--out", tmp_path / "o", "--timeout", "0.3", "--workers", "1")
    assert "dev         1 records     2 skipped (1 database missing, 1 gold fails)" in out, out
    recs = load_examples(tmp_path / "o/dev.jsonl", src)
    assert recs[0]["id"] == "bird-dev-0" and recs[0]["evidence"] == "name refers to t.name"
    assert recs[0]["db_path"] == "dev_databases/x/x.sqlite" and recs[0]["source"] == "bird"
    tr = load_examples(tmp_path / "o/train.jsonl", src)
    assert tr[0]["db_path"] == "train/train_databases/y/y.sqlite" and tr[0]["evidence"] == "e"
    reasons = sorted(s["reason"] for s in read_jsonl(tmp_path / "o/skipped_dev.jsonl"))
    assert reasons[0] == "database missing: nope" and reasons[1].startswith("gold fails: timeout")


# -----------------------------------------------------------------------------
# SkyRL-SQL


SYSTEM = ("You are a data science expert.\n\nQuestion: how many pigs are in the farm?\n"
          "<think>...</think><solution>SELECT COUNT(*) FROM animals</solution>")


def user(question, evidence=""):
    return (f"Database Engine:\nSQLite\n\nDatabase Schema:\nCREATE TABLE t (id INTEGER);\n\n"
            f"External Knowledge:\n{evidence}\n\nQuestion:\n{question}\n\nInstructions:\n- Think first.\n")


def sky_row(i, data, db_id, question, gold, evidence=""):
    return {"data_source": data, "prompt": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": user(question, evidence)}],
            "env_class": "text2sql", "reward_spec": {"method": "rule", "ground_truth": gold},
            "db_id": db_id, "data": data, "extra_info": {"split": "train", "index": i}}


def test_question_from_prompt():
    q, ev = prepare_skyrl.question_from_prompt([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": user("Which rows\nhave ids?", "id is a key")}])
    assert (q, ev) == ("Which rows\nhave ids?", "id is a key")
    assert prepare_skyrl.question_from_prompt("Question: How many?") == ("How many?", "")
    assert prepare_skyrl.question_from_prompt([{"role": "user", "content": "no marker"}])[0] is None


def test_skyrl_parquet_fixture(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    roots = tmp_path / "dbs"
    make_db(roots / "SynSQL-2.5M/databases/s1/s1.sqlite")
    make_db(roots / "spider/database/sp/sp.sqlite")
    rows = [sky_row(0, "synsql", "s1", "How many rows?", "SELECT COUNT(*) FROM t", "rows are records"),
            sky_row(1, "spider", "sp", "List names.", "SELECT name FROM t"),
            sky_row(2, "bird", "b", "Bird?", "SELECT 1"),  # no --bird-root given
            sky_row(3, "synsql", "gone", "Gone?", "SELECT 1"),
            sky_row(4, "synsql", "s1", "Broken?", "SELECT nope FROM t")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    out = run("prepare_skyrl.py", "--src", tmp_path / "d.parquet", "--out", tmp_path / "o", "--exec", "--workers", "1",
              "--synsql-root", roots / "SynSQL-2.5M", "--spider-root", roots / "spider")
    assert "train         2 records     3 skipped" in out, out
    recs = load_examples(tmp_path / "o/train.jsonl", roots)  # db_root = the roots' common folder
    assert [(r["id"], r["source"], r["question"], r["evidence"]) for r in recs] == [
        ("skyrl-train-0", "skyrl-synsql", "How many rows?", "rows are records"),
        ("skyrl-train-1", "skyrl-spider", "List names.", "")]
    assert recs[0]["db_path"] == "SynSQL-2.5M/databases/s1/s1.sqlite" and recs[1]["gold_sql"] == "SELECT name FROM t"
    reasons = {s["id"]: s["reason"] for s in read_jsonl(tmp_path / "o/skipped_train.jsonl")}
    assert reasons["skyrl-train-2"] == "database root not given: --bird-root"
    assert reasons["skyrl-train-3"].startswith("database missing: gone")
    assert reasons["skyrl-train-4"].startswith("gold fails")


def test_skyrl_omnisql_json(tmp_path):
    make_db(tmp_path / "syn/databases/s1/s1.sqlite")
    rows = [{"db_id": "s1", "question": "Count?", "external_knowledge": "k", "sql": "SELECT COUNT(*) FROM t",
             "cot": "..."}]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    run("prepare_skyrl.py", "--src", tmp_path / "data.json", "--out", tmp_path / "o", "--synsql-root", tmp_path / "syn")
    r = load_examples(tmp_path / "o/train.jsonl", tmp_path / "syn")[0]
    assert (r["id"], r["source"], r["evidence"], r["db_path"]) == ("synsql-train-0", "synsql", "k", "databases/s1/s1.sqlite")


def test_skyrl_without_pyarrow_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(SystemExit, match="pip install pyarrow"):
        prepare_skyrl.read_parquet(tmp_path / "x.parquet")
