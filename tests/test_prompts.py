"""sqltask/prompts.py: schema DDL against SQLite itself (every Spider database), the truncation order and
its report, and the three templates."""
import re
import sqlite3
import statistics

import pytest

from sqltask import prompts
from config import DataConfig
from conftest import HAVE_SPIDER, ROOT, SPIDER, SPIDER_MISSING

from toy.prepare_toy import prepare_toy  # noqa: E402


def build(path, script):
    con = sqlite3.connect(path)
    con.executescript(script)
    con.commit()
    con.close()
    return str(path)


def schema_of(con):
    """Reference: tables, columns, pks and fks as SQLite reports them."""
    out = {}
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'"):
        info = con.execute(f'PRAGMA table_info("{t}")').fetchall()
        fks = sorted((r[2], r[3]) for r in con.execute(f'PRAGMA foreign_key_list("{t}")'))
        out[t] = ([r[1] for r in info], [r[1] for r in sorted(info, key=lambda r: r[5]) if r[5]], fks)
    return out


@pytest.mark.skipif(not HAVE_SPIDER, reason=SPIDER_MISSING)
def test_every_spider_database_round_trips_and_fits_budgets():
    dbs = sorted((SPIDER / "database").glob("*/*.sqlite"))
    assert len(dbs) == 163
    for db in dbs:
        text, info = prompts.schema_ddl(db, sample_values=3)
        assert not info["truncated"] and "CREATE TABLE" in text
        mem = sqlite3.connect(":memory:")
        mem.executescript(text)  # the DDL (with its example comments) is valid SQLite ...
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as src:
            assert schema_of(mem) == schema_of(src), db.name  # ... and describes the same schema
        for budget in (400, 120):
            cut, info = prompts.schema_ddl(db, sample_values=3, max_tokens=budget)
            sqlite3.connect(":memory:").executescript(cut)
            assert info["tokens"] == prompts.approx_tokens(cut)
            assert info["tokens"] <= budget or len(info["dropped_tables"]) == len(schema_of(mem)) - 1, (db, info)
            if info["tokens"] < prompts.approx_tokens(text):
                assert info["truncated"] and info["dropped_samples"] == ("-- example:" in text)
            for t, cols in info["dropped_columns"].items():
                if t not in info["dropped_tables"]:
                    block = re.search(rf'CREATE TABLE "?{re.escape(t)}"? \((.*?)\n\);', cut, re.S).group(1)
                    names = {ln.split()[0].strip('"') for ln in block.splitlines() if ln.strip() and not ln.strip().startswith(("--", "PRIMARY", "FOREIGN"))}
                    assert not names & set(cols) and "more column(s) not shown" in block


@pytest.fixture
def shop(tmp_path):
    return build(tmp_path / "s.sqlite", """
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, notes TEXT);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, item_id INTEGER, amount REAL, memo TEXT,
            FOREIGN KEY (customer_id) REFERENCES customers(id), FOREIGN KEY (item_id) REFERENCES items(id));
        CREATE TABLE items (id INTEGER PRIMARY KEY, label TEXT, "unit price" REAL);
        CREATE TABLE audit_log (ts TEXT, who TEXT, what TEXT, detail TEXT, extra1 TEXT, extra2 TEXT);
        INSERT INTO customers VALUES (1, 'Ann', 'Oslo', 'line1
line2'), (2, 'Bob', NULL, NULL);
        INSERT INTO items VALUES (1, 'lamp', 9.5);
        INSERT INTO audit_log VALUES ('t', 'w', 'x', 'd', 'e', 'f');""")


def test_exact_ddl(shop):
    text, info = prompts.schema_ddl(shop, sample_values=2)
    assert text.split("\n\n")[0] == (
        "CREATE TABLE customers (\n"
        "  id INTEGER, -- example: [1, 2]\n"
        "  name TEXT, -- example: ['Ann', 'Bob']\n"
        "  city TEXT, -- example: ['Oslo']\n"
        "  notes TEXT, -- example: ['line1 line2']\n"
        "  PRIMARY KEY (id)\n);")
    assert '  "unit price" REAL, -- example: [9.5]' in text
    assert "FOREIGN KEY (customer_id) REFERENCES customers (id),\n  FOREIGN KEY (item_id) REFERENCES items (id)" in text
    assert "audit_log (\n  ts TEXT, -- example: ['t']" in text and text.endswith("extra2 TEXT -- example: ['f']\n);")
    assert prompts.schema_text(shop, "compact")[0].splitlines()[:2] == [
        "customers(id, name, city, notes)", "orders(id, customer_id, item_id, amount, memo)"]


def test_truncation_order(shop):
    full = prompts.approx_tokens(prompts.schema_ddl(shop, 2)[0])
    bare = prompts.approx_tokens(prompts.schema_ddl(shop, 0)[0])
    # 1. a budget between the two: only the sample values go
    _, info = prompts.schema_ddl(shop, 2, max_tokens=(full + bare) // 2)
    assert info["dropped_samples"] and not info["dropped_columns"] and not info["dropped_tables"]
    # 2. a bit less than bare: columns of the isolated table (audit_log) go first, never its first
    text, info = prompts.schema_ddl(shop, 2, max_tokens=bare - 10)
    assert list(info["dropped_columns"]) == ["audit_log"] and info["tokens"] <= bare - 10
    assert "ts TEXT" in text and "extra2" not in text
    # 3. much less: keys are never dropped from a table that is shown; whole tables go last
    text, info = prompts.schema_ddl(shop, 2, max_tokens=60)
    assert info["dropped_tables"] and info["tokens"] <= 60 or len(info["dropped_tables"]) == 3
    if "CREATE TABLE orders" in text:
        assert "customer_id" in text and "item_id" in text
    assert "more table(s) not shown: " + info["dropped_tables"][0] in text
    # a custom counter is used
    _, info = prompts.schema_ddl(shop, 0, max_tokens=10**6, count_tokens=lambda s: len(s.split()))
    assert info["tokens"] == len(prompts.schema_ddl(shop)[0].split())


def test_schema_is_cached(shop):
    assert prompts.read_schema(shop) is prompts.read_schema(shop)
    with pytest.raises(FileNotFoundError):
        prompts.read_schema(shop + ".nope")


def test_templates(shop):
    ex = {"id": "1", "db_id": "s", "db_path": "s.sqlite", "question": "How many customers?",
          "evidence": "customers are people", "gold_sql": "SELECT COUNT(*) FROM customers", "db_file": shop}
    sky = prompts.build_messages(ex, None, DataConfig(prompt_template="skyrl", schema_sample_values=2))
    assert [m["role"] for m in sky] == ["system", "user"]
    for tag in ("<think>", "<sql>", "<observation>", "<solution>", "SQLite"):
        assert tag in sky[0]["content"]
    u = sky[1]["content"]
    assert "CREATE TABLE orders" in u and "-- example:" in u and "customers are people" in u
    assert u.rstrip().endswith("How many customers?")
    comp = prompts.build_messages(ex, None, DataConfig(prompt_template="compact"))
    assert comp[1]["content"].endswith("Hint: customers are people\nQuestion: How many customers?")
    assert comp[1]["content"].startswith("customers(id, name, city, notes)\norders(")
    act = prompts.build_messages(ex, None, DataConfig(prompt_template="skyrl"), protocol="actions")
    assert "DESCRIBE" in act[0]["content"] and "<action>" in act[0]["content"]
    assert act[1]["content"].startswith("Tables: customers, orders, items, audit_log") and "CREATE" not in act[1]["content"]
    small = prompts.build_messages(ex, None, DataConfig(prompt_template="compact"), protocol="actions")
    assert "<action>ANSWER sql</action>" in small[0]["content"] and len(small[0]["content"]) < 200
    with pytest.warns(UserWarning, match="schema of s cut"):
        prompts.build_messages(ex, None, DataConfig(prompt_template="skyrl", schema_max_tokens=50))


def test_toy_compact_prompts_are_short(tmp_path):
    from sqltask.dataset import load_examples
    prepare_toy(tmp_path, seed=0)
    exs = load_examples(tmp_path / "eval.jsonl", tmp_path)
    lens = [len(prompts.build_messages(e, tmp_path, DataConfig(prompt_template="compact"))[1]["content"]) for e in exs]
    assert statistics.median(lens) < 250, statistics.median(lens)
