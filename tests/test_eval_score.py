"""eval.py score: the command line on a tiny set of our own, the official input handling, and
per-example agreement with the official test-suite evaluator's verdicts on published Spider
predictions (spider_preds/ beside the Spider folder: dev predictions with the official evaluator's
verdicts; skipped when absent).

Run: .venv/bin/pytest tests/test_eval_score.py -q
"""
import json
import sqlite3
import subprocess
import sys

import pytest
from conftest import HAVE_SPIDER, ROOT, SPIDER, SPIDER_MISSING

from sqltask import spider_score

PREDS = SPIDER.parent / "spider_preds"
HAVE_PREDS = HAVE_SPIDER and (PREDS / "c3sql_gpt35.verdicts.jsonl").exists()
# Examples where we deliberately differ from the official verdicts: none.
DOCUMENTED_DIFFERENCES: dict[str, list[int]] = {"c3sql_gpt35": [], "codex_fewshot": []}


@pytest.fixture()
def tiny_set(tmp_path):
    root = tmp_path / "database"
    (root / "shop").mkdir(parents=True)
    c = sqlite3.connect(root / "shop" / "shop.sqlite")
    c.execute("CREATE TABLE item (id INT, name TEXT, price REAL)")
    c.executemany("INSERT INTO item VALUES (?,?,?)", [(1, "a", 1.5), (2, "b", 2.0), (3, "b", 3.0)])
    c.commit()
    c.close()
    gold = tmp_path / "gold.sql"
    gold.write_text("SELECT name FROM item ORDER BY price\tshop\n"
                    "SELECT DISTINCT name FROM item\tshop\n"
                    "SELECT count(*) FROM item WHERE price > 1\tshop\n"
                    "SELECT 1\tmissing_db\n"
                    "SELECT id, name FROM item\tshop\n")
    pred = tmp_path / "pred.sql"
    pred.write_text("SELECT name FROM item ORDER BY price DESC\n"  # wrong order
                    "SELECT name FROM item\n"  # DISTINCT removed from both: a bag of 3 == 3
                    "SELECT count(*) FROM item WHERE price > value \tshop\n"  # TAB cut, ' value ' -> ' 1 '
                    "SELECT 1\n"
                    "SELECT name, id FROM item;\n")  # permuted columns
    return tmp_path, gold, pred, root


def test_score_cli(tiny_set):
    tmp, gold, pred, root = tiny_set
    out = tmp / "out.jsonl"
    p = subprocess.run([sys.executable, str(ROOT / "eval.py"), "score", "--pred", str(pred), "--gold", str(gold),
                        "--db-root", str(root), "--out", str(out)], capture_output=True, text=True, cwd=tmp)
    assert p.returncode == 0, p.stderr
    assert "EX 3/4 = 75.00% (1 skipped" in p.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2, 3, 4]
    assert [r["exec_match"] for r in recs] == [False, True, True, False, True]
    assert recs[3]["skipped"] and recs[3]["db_id"] == "missing_db"
    assert set(recs[0]) >= {"index", "db_id", "exec_match", "error"}


def test_score_names_a_corrupt_or_empty_database_in_its_summary_line(tiny_set):
    """Before: a corrupt database gave "EX 0/8 (0 skipped: database missing)", the reason only in
    --out. Now its examples are skipped, and the summary line counts them and names the file."""
    tmp, gold, pred, root = tiny_set
    (root / "broken").mkdir()
    (root / "broken" / "broken.sqlite").write_bytes(b"not a database" * 64)
    (root / "empty").mkdir()
    (root / "empty" / "empty.sqlite").write_bytes(b"")
    gold.write_text(gold.read_text() + "SELECT 1\tbroken\nSELECT 2\tbroken\nSELECT 3\tempty\n")
    pred.write_text(pred.read_text() + "SELECT 1\nSELECT 2\nSELECT 3\n")
    out = tmp / "out.jsonl"
    p = subprocess.run([sys.executable, str(ROOT / "eval.py"), "score", "--pred", str(pred), "--gold", str(gold),
                        "--db-root", str(root), "--out", str(out)], capture_output=True, text=True, cwd=tmp)
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip().splitlines()[-1]
    assert line.startswith("mode spider: EX 3/4 = 75.00% (4 skipped: 1 database missing, 3 on an unusable database: "
                           f"{root}/broken/broken.sqlite: not a readable SQLite database (file is not a database); "
                           f"{root}/empty/empty.sqlite: the database is an empty file (0 bytes))"), line
    recs = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["skipped"] for r in recs[5:]] == [True] * 3 and "file is not a database" in recs[5]["error"]
    missing = subprocess.run([sys.executable, str(ROOT / "eval.py"), "score", "--pred", str(tmp / "nope.sql"),
                              "--gold", str(gold), "--db-root", str(root)], capture_output=True, text=True, cwd=tmp)
    assert missing.returncode == 1 and missing.stderr == f"error: --pred {tmp / 'nope.sql'}: no such file\n"


def test_score_modes_and_errors(tiny_set):
    tmp, gold, pred, root = tiny_set
    lines = pred.read_text().splitlines()
    g = spider_score.read_gold(gold)
    set_mode = [r["exec_match"] for r in spider_score.score(lines, g, str(root), "set")]
    assert set_mode == [True, True, False, False, False]  # no TAB cut / 'value' handling outside spider
    bad = spider_score.score(["SELECT nope FROM item"] + lines[1:], g, str(root))
    assert not bad[0]["exec_match"] and "no such column" in bad[0]["error"]
    with pytest.raises(SystemExit):
        spider_score.score(lines[:2], g, str(root))
    assert spider_score.official_pred_text("  SELECT a\tdb\n") == "SELECT a"


@pytest.mark.skipif(not HAVE_PREDS, reason=SPIDER_MISSING + " (or spider_preds missing)")
@pytest.mark.parametrize("system", ["c3sql_gpt35", "codex_fewshot"])
def test_agrees_with_official_verdicts(system):
    gold = spider_score.read_gold(str(SPIDER / "dev_gold.sql"))
    lines = (PREDS / f"{system}.sql").read_text().split("\n")[:len(gold)]
    recs = spider_score.score(lines, gold, str(SPIDER / "database"), "spider")
    agree, n, diff = spider_score.compare_verdicts(recs, str(PREDS / f"{system}.verdicts.jsonl"))
    assert n == 972 and sum(r["skipped"] for r in recs) == 62
    assert diff == DOCUMENTED_DIFFERENCES[system], [(i, recs[i]) for i in diff[:5]]
    official = [json.loads(x) for x in (PREDS / f"{system}.verdicts.jsonl").read_text().splitlines()]
    assert sum(r["exec_match"] for r in recs) == sum(v["exec_match"] for v in official if not v["skipped"])
