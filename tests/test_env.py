"""env.py and sqltask/sandbox.py: the SQL sandbox (adversarial suite on copies of Spider databases), the worker pool,
turn parsing for both protocols, observation formatting, step_batch.

Run: .venv/bin/pytest tests/test_env.py -q
"""
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HAVE_SPIDER, ROOT, SPIDER, SPIDER_MISSING
from hypothesis import given, settings
from hypothesis import strategies as st

import env
from sqltask import sandbox
from config import EnvConfig

T = 1.0  # tool timeout used in these tests
T_ADV = 0.5  # the adversarial suite's (many of its queries run into it)
# How late a deadline's answer may come on a loaded machine (other test sessions, a training run
# beside this one: the answer waits for a core). Generous on purpose: what the timing checks show
# is that a deadline is enforced at all, and the queries they time run for minutes, or forever,
# without one.
LATE_S = 2.5


@pytest.fixture(scope="module")
def tiny_db(tmp_path_factory):
    """A database of our own (so most tests run without Spider), with invalid UTF-8 text."""
    path = tmp_path_factory.mktemp("tinydb") / "tiny.sqlite"
    c = sqlite3.connect(path)
    c.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, age INT)")
    c.executemany("INSERT INTO singer VALUES (?,?,?)", [(i, f"s{i}", 20 + i) for i in range(60)])
    c.execute("CREATE TABLE bad (t TEXT)")
    c.execute("INSERT INTO bad VALUES (CAST(x'41ff42' AS TEXT))")  # 'A', invalid byte, 'B'
    c.commit()
    c.close()
    return path


def _copies(tmp_path_factory):
    """Private copies of a few Spider databases (the shared folder is read-only)."""
    out = tmp_path_factory.mktemp("spider_copies")
    paths = []
    for db in ("concert_singer", "world_1", "car_1"):
        d = out / db
        d.mkdir()
        shutil.copy(SPIDER / "database" / db / f"{db}.sqlite", d / f"{db}.sqlite")
        paths.append(d / f"{db}.sqlite")
    return paths


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _listing(dirs) -> set:
    out = set()
    for d in dirs:
        try:
            out |= {os.path.join(d, n) for n in os.listdir(d)}
        except OSError:
            pass
    return out


# -----------------------------------------------------------------------------
# sandbox basics

def test_rows_columns_truncation_and_utf8(tiny_db):
    r = env.run_sql(tiny_db, "SELECT name, age FROM singer ORDER BY id", timeout_s=T, max_rows=10)
    assert r.ok and r.columns == ["name", "age"] and len(r.rows) == 10 and r.truncated
    assert r.rows[0] == ("s0", 20)
    r = env.run_sql(tiny_db, "SELECT t FROM bad", timeout_s=T)
    assert r.ok and r.rows == [("A\ufffdB",)]  # replacement, not a crash
    full = env.run_sql(tiny_db, "SELECT id FROM singer", timeout_s=T, max_rows=60)
    assert len(full.rows) == 60 and not full.truncated


@pytest.mark.parametrize("sql", ["SELECT count(*) FROM singer;", "SELECT count(*) FROM singer ;; \n",
                                 "SELECT count(*) FROM singer; -- done", "-- q\nSELECT count(*) FROM singer /* c */ ;",
                                 ";SELECT count(*) FROM singer"])
def test_trailing_semicolons_and_comments(tiny_db, sql):
    r = env.run_sql(tiny_db, sql, timeout_s=T)
    assert r.ok and r.rows == [(60,)], r.error


@pytest.mark.parametrize("sql,needle", [("SELECT 1; SELECT 2", "one SQL statement"),
                                        ("SELECT 1; DROP TABLE singer", "one SQL statement"),
                                        ("", "empty"), ("  ;; -- nothing", "empty"),
                                        ("SELEC 1", "syntax error"), ("SELECT * FROM nope", "no such table")])
def test_clean_errors(tiny_db, sql, needle):
    r = env.run_sql(tiny_db, sql, timeout_s=T)
    assert not r.ok and needle in r.error and not r.timed_out


def test_reused_connections_see_a_rewritten_database(tmp_path):
    p = tmp_path / "c.sqlite"
    c = sqlite3.connect(p)
    c.execute("CREATE TABLE t (a)")
    c.execute("INSERT INTO t VALUES (1)")
    c.commit()
    assert all(r.rows == [(1,)] for r in env.run_sql_batch([(p, "SELECT count(*) FROM t")] * 8, timeout_s=T))
    time.sleep(0.01)
    c.execute("INSERT INTO t VALUES (2)")
    c.commit()
    c.close()
    assert all(r.rows == [(2,)] for r in env.run_sql_batch([(p, "SELECT count(*) FROM t")] * 8, timeout_s=T))


def test_missing_database_is_an_error_and_creates_nothing(tmp_path):
    r = env.run_sql(tmp_path / "nope.sqlite", "SELECT 1", timeout_s=T)
    assert not r.ok and "no such database" in r.error
    assert list(tmp_path.iterdir()) == []


def test_sql_tokens_round_trip_and_trim():
    for s in ["SELECT 'a;b' FROM t -- x;\n;", "SELECT \"x\"\"y\" /* ; */ ;", "SELECT 'unterminated", "[a;b]`c`"]:
        assert "".join(sandbox.sql_tokens(s)) == s
    assert sandbox.trim_sql(" ;SELECT 'a;' ; -- c\n ; ") == "SELECT 'a;'"


# -----------------------------------------------------------------------------
# adversarial suite: no writes, no new files, deadlines kept, a clean error each

ADVERSARIAL = [
    "INSERT INTO {t} SELECT * FROM {t}", "UPDATE {t} SET {c} = NULL", "DELETE FROM {t}", "DROP TABLE {t}",
    "CREATE TABLE x(a)", "CREATE INDEX ix ON {t}({c})", "ALTER TABLE {t} ADD COLUMN zz", "CREATE VIEW v AS SELECT 1",
    "CREATE TRIGGER tr AFTER INSERT ON {t} BEGIN SELECT 1; END", "REPLACE INTO {t} SELECT * FROM {t}",
    "WITH q AS (SELECT 1) INSERT INTO {t} SELECT * FROM {t}",
    "ATTACH DATABASE '{new}' AS evil", "ATTACH ':memory:' AS m", "DETACH main",
    "VACUUM", "VACUUM INTO '{new}'", "REINDEX", "ANALYZE",
    "PRAGMA writable_schema=1", "PRAGMA journal_mode=WAL", "PRAGMA query_only=0", "PRAGMA temp_store=FILE",
    "PRAGMA temp_store_directory='{dir}'", "SELECT * FROM pragma_table_info('{t}')",
    "CREATE TEMP TABLE tt(a)", "CREATE TEMP TABLE tt AS SELECT * FROM {t}", "CREATE TEMP VIEW tv AS SELECT 1",
    "BEGIN", "BEGIN IMMEDIATE", "COMMIT", "SAVEPOINT s", "SELECT load_extension('/tmp/evil')",
    "SELECT 1; DROP TABLE {t}", "SELECT 1; ATTACH '{new}' AS e",
    "SELECT randomblob(800000000)", "SELECT zeroblob(1000000000)", "SELECT length(printf('%.*c', 900000000, 'x'))",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r",
    "WITH RECURSIVE r(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM r) SELECT max(length(s)) FROM r",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT group_concat(i) FROM r",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM r LIMIT 100) "
    "SELECT count(*) FROM {t} a, {t} b, r, r r2, r r3, r r4, r r5",  # cross joins
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM r LIMIT 100) "
    "SELECT * FROM {t} a, r, r r2, r r3, r r4 ORDER BY random()",  # a huge in-memory sort
]


NULL_OVER_LIMIT = {"SELECT length(printf('%.*c', 900000000, 'x'))"}


def _adversarial_run(dbs, tmp_path):
    hashes = {p: _sha(p) for p in dbs}
    watch = [str(p.parent) for p in dbs] + ["/tmp", "/var/tmp", os.getcwd(), str(tmp_path)]
    before = _listing(watch)
    new = tmp_path / "evil.sqlite"
    for db in dbs:
        t, c = sqlite3.connect(f"file:{db}?mode=ro", uri=True).execute(
            "SELECT m.name, p.name FROM sqlite_master m, pragma_table_info(m.name) p WHERE m.type='table'").fetchone()
        for q in ADVERSARIAL:
            sql = q.format(t=f'"{t}"', c=f'"{c}"', new=new, dir=tmp_path)
            t0 = time.monotonic()  # (a worker killed by the previous query may still be booting)
            r = env.run_sql(db, sql, timeout_s=T_ADV)
            wall = time.monotonic() - t0
            # the deadline holds: ordinary queries are interrupted at it, a single long opcode
            # (printf's padding loop here) is killed at the hard wall budget, KILL_MARGIN_S later
            assert wall < T_ADV + sandbox.KILL_MARGIN_S + LATE_S, (sql, wall, r.error)
            if r.ok:  # some SQLite builds answer NULL when printf's width passes
                # SQLITE_LIMIT_LENGTH, where 3.40 raises "string or blob too big": nothing was
                # allocated either way
                assert sql in NULL_OVER_LIMIT and r.rows == [(None,)], (sql, r)
                continue
            assert r.error, (sql, r)
            assert "\n" not in r.error and len(r.error) < 300, r.error  # one clean line
    for p, h in hashes.items():
        assert _sha(p) == h, f"{p} changed"
    assert not new.exists()
    appeared = _listing(watch) - before
    ours = [f for f in appeared if "etilqs" in f or "evil" in f or f.endswith(("-journal", "-wal", "-shm"))
            or any(Path(f).name.startswith(p.stem) for p in dbs)]
    assert not ours, ours
    for w in sandbox.get_pool().workers:  # nor unlinked temp files still held open by a worker
        fd_dir = f"/proc/{w.proc.pid}/fd"
        for fd in os.listdir(fd_dir) if os.path.isdir(fd_dir) else []:
            if int(fd) <= 2:  # stdio inherited from pytest's capture (an O_TMPFILE of its own)
                continue
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:  # closed meanwhile
                continue
            assert "(deleted)" not in target, target


def test_adversarial_on_our_db(tiny_db, tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    shutil.copy(tiny_db, d / "tiny.sqlite")
    _adversarial_run([d / "tiny.sqlite"], tmp_path)


@pytest.mark.skipif(not HAVE_SPIDER, reason=SPIDER_MISSING)
def test_adversarial_on_spider_copies(tmp_path_factory, tmp_path):
    _adversarial_run(_copies(tmp_path_factory), tmp_path)


def test_single_long_opcode_is_killed_and_worker_replaced(tiny_db):
    # instr() over a 1 MB haystack and a 300 KB needle is one opcode running for ~10 s: the progress
    # handler never fires, only the pool's hard wall budget (timeout + KILL_MARGIN_S) stops it
    slow = "SELECT instr(printf('%.*c', 1000000, 'a'), printf('%.*c', 300000, 'a') || 'b')"
    # two workers, whatever size an earlier test left the shared pool at: with one, the second
    # query would wait behind the killed one and miss its own deadline
    pool = sandbox.get_pool(2).wait_ready()
    before = pool.replaced
    t0 = time.monotonic()
    rs = env.run_sql_batch([(tiny_db, slow), (tiny_db, "SELECT count(*) FROM singer")], timeout_s=0.3, workers=2)
    wall = time.monotonic() - t0
    assert rs[0].timed_out and not rs[0].ok and "killed" in rs[0].error
    assert rs[1].ok and rs[1].rows == [(60,)]  # in order, unaffected
    assert wall < 0.3 + sandbox.KILL_MARGIN_S + LATE_S, wall  # unkilled, the opcode runs ~10 s
    assert pool.replaced == before + 1  # killed: one worker replaced
    assert env.run_sql(tiny_db, "SELECT 1", timeout_s=T).rows == [(1,)]  # the replacement works


def test_pool_order_memory_cap_and_byte_cap(tiny_db):
    jobs = [(tiny_db, f"SELECT {i}, count(*) FROM singer WHERE id < {i}") for i in range(200)]
    jobs[7] = (tiny_db, "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM r) SELECT count(*) FROM r")
    rs = env.run_sql_batch(jobs, timeout_s=0.3)
    assert rs[7].timed_out and "interrupted" in rs[7].error
    assert all(r.rows == [(i, min(i, 60))] for i, r in enumerate(rs) if i != 7)
    # RLIMIT_AS is set in every worker (wait_ready: the worker replacing the timed-out one may
    # still be booting, before its setrlimit, on a loaded machine)
    for w in sandbox.get_pool().wait_ready().workers:
        limits = Path(f"/proc/{w.proc.pid}/limits").read_text()
        line = next(l for l in limits.splitlines() if l.startswith("Max address space"))
        assert "unlimited" not in line, line
    # 300 MB of 3 MB blobs: the fetched bytes are capped, the result is marked truncated
    big = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM r LIMIT 100) SELECT zeroblob(3000000) FROM r"
    r = env.run_sql(tiny_db, big, timeout_s=5)
    assert r.ok and r.truncated and len(r.rows) < 30


def test_timeout_answered_before_sqlite_cleanup(tiny_db):
    # 2 s of an unbounded in-memory sort holds ~100 MB; freeing it takes 0.1-0.3 s after the
    # interrupt. The worker answers first, cleans up after, and takes no job until it is idle.
    # The order is read from the pool, not a clock: when the answer is back, the worker that gave
    # it is still cleaning up (an answer sent after the clean-up would find it idle).
    sort = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM r) SELECT i FROM r ORDER BY random()"
    pool = sandbox.get_pool().wait_ready()
    t0 = time.monotonic()
    r = env.run_sql(tiny_db, sort, timeout_s=2.0)
    assert r.timed_out and "interrupted" in r.error and time.monotonic() - t0 < 2.0 + LATE_S
    assert [w.cleaning for w in pool.workers].count(True) == 1
    rs = env.run_sql_batch([(tiny_db, "SELECT count(*) FROM singer")] * 4, timeout_s=T)
    assert all(x.rows == [(60,)] for x in rs)
    assert not any(w.cleaning for w in pool.workers)


@pytest.mark.parametrize("sql", [None, "SELECT " + "1+" * 60_000 + "1", b"SELECT 1"])
def test_bad_sql_objects(tiny_db, sql):
    r = env.run_sql(tiny_db, sql, timeout_s=T)
    assert not r.ok and "at most 100 KB" in r.error


def test_pool_survives_a_worker_killed_from_outside(tiny_db):
    pool = sandbox.get_pool()
    env.run_sql(tiny_db, "SELECT 1")
    before = pool.replaced
    victim = pool.workers[0].proc
    os.kill(victim.pid, 9)
    victim.join(5)
    rs = env.run_sql_batch([(tiny_db, f"SELECT {i}") for i in range(10)], timeout_s=T)
    assert [r.rows for r in rs] == [[(i,)] for i in range(10)]
    assert pool.replaced == before + 1


def test_workers_do_not_reimport_the_callers_main(tiny_db, tmp_path):
    # spawn would re-run the caller's script in every worker (train.py: torch in each of them)
    marker, script = tmp_path / "imports.txt", tmp_path / "main.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nopen({str(marker)!r}, 'a').write('x')\n"
                      f"import env\nif __name__ == '__main__':\n"
                      f"    print(env.run_sql_batch([({str(tiny_db)!r}, 'SELECT 41 + 1')] * 4, timeout_s=5)[3].rows)\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "[(42,)]", p.stderr
    assert marker.read_text() == "x"


def test_batch_runs_in_parallel_and_pool_survives(tiny_db):
    """A batch of queries that each run into their deadline, one per worker: they time out together
    (about one deadline in all), not one after the other (one deadline each). The deadline is long
    enough that the two differ by more than a loaded machine's delay."""
    sleepy = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM r) SELECT count(*) FROM r"
    n = sandbox.get_pool(2).wait_ready().n  # (a worker replaced by an earlier test may still be booting)
    deadline = 2.0
    t0 = time.monotonic()
    rs = env.run_sql_batch([(tiny_db, sleepy)] * n, timeout_s=deadline)
    wall = time.monotonic() - t0
    assert all(r.timed_out for r in rs) and n == 2
    assert wall < (n - 0.5) * deadline, wall  # one after the other: >= n x the deadline


# -----------------------------------------------------------------------------
# real Spider: every database opens and every table reads

@pytest.mark.skipif(not HAVE_SPIDER, reason=SPIDER_MISSING)
def test_schema_smoke_all_databases():
    dbs = sorted((SPIDER / "database").glob("*/*.sqlite"))
    assert len(dbs) == 163
    names = env.table_names(dbs)
    jobs = [(db, f'SELECT * FROM "{t}" LIMIT 3') for db in dbs for t in names[str(db)]]
    assert all(names[str(db)] for db in dbs)
    rs = env.run_sql_batch(jobs, timeout_s=5)
    bad = [(j, r.error) for j, r in zip(jobs, rs) if not r.ok]
    assert not bad, bad[:5]
    assert env.table_names_text(dbs[0]).startswith("Tables: ")


# -----------------------------------------------------------------------------
# parsing

TAG_CASES = [
    ("<think>x</think>\n<sql>SELECT 1</sql>", "sql", "SELECT 1"),
    ("<think>x</think><solution>SELECT 2</solution>", "solution", "SELECT 2"),
    ("<think>no action</think>", "invalid", ""),
    ("<think>x</think><sql>SELECT 1", "invalid", ""),  # unclosed
    ("<sql>SELECT 1</sql> and <sql>SELECT 2</sql>", "sql", "SELECT 1"),  # the first counts
    ("<sql><sql>SELECT 3</sql>", "sql", "SELECT 3"),  # repeated opening
    ("<sql>   </sql>", "sql", ""),  # empty SQL: a tool call the tool answers with an error
    ("<sql>```sql\nSELECT 4\n```</sql>", "sql", "SELECT 4"),  # fence inside the tag
    ("<sql>```\nSELECT 5;\n```\n</sql>", "sql", "SELECT 5;"),
    ("<sql>```sqlite SELECT 6```</sql>", "sql", "SELECT 6"),
    ("```\n<sql>SELECT 7</sql>\n```", "sql", "SELECT 7"),  # tags inside a fence
    ("<sql>SELECT 1</sql><solution>SELECT 8</solution>", "solution", "SELECT 8"),  # SkyRL: done wins
    ("</sql><sql>SELECT 9</sql>", "sql", "SELECT 9"),
    ("<solution>SELECT 10", "invalid", ""),
    ("<SQL>SELECT 1</SQL>", "invalid", ""),  # tags are exact (they are the stop strings)
]


@pytest.mark.parametrize("text,kind,arg", TAG_CASES)
def test_parse_tags(text, kind, arg):
    a = env.parse_turn(text, "tags")
    assert (a.kind, a.arg) == (kind, arg)


ACTION_CASES = [
    ("<action>DESCRIBE singer</action>", "describe", "singer"),
    ("think first\n<action>sample `singer`;</action>", "sample", "singer"),
    ("<action>QUERY: SELECT name FROM singer</action>", "query", "SELECT name FROM singer"),
    ("<action>ANSWER ```sql\nSELECT 1\n```</action>", "answer", "SELECT 1"),
    ("<action>DROP singer</action>", "invalid", ""),
    ("QUERY SELECT 1", "invalid", ""),
]


@pytest.mark.parametrize("text,kind,arg", ACTION_CASES)
def test_parse_actions(text, kind, arg):
    a = env.parse_turn(text, "actions")
    assert (a.kind, a.arg) == (kind, arg)


def test_parse_very_long_text_is_fast():
    junk = "<think>" + "a <sql b < / sql> " * 200_000
    t0 = time.perf_counter()
    assert env.parse_turn(junk, "tags").kind == "invalid"
    assert env.parse_turn(junk + "<sql>SELECT 1</sql>", "tags").arg == "SELECT 1"
    assert env.parse_turn("<sql>```" + "x" * 1_000_000, "tags").kind == "invalid"
    # linear: ~0.01 s here; a backtracking pattern on these 3.6 MB takes hours. 10 s leaves a loaded
    # machine its delay and still catches any super-linear parse
    assert time.perf_counter() - t0 < 10.0


@settings(max_examples=300, deadline=None)
@given(pre=st.text(), sql=st.text(), post=st.text())
def test_parse_property(pre, sql, post):
    env.parse_turn(pre + sql + post, "tags")  # never raises
    env.parse_turn(pre + sql + post, "actions")
    if all(s not in pre + sql for s in ("<sql>", "</sql>", "<solution>", "</solution>")) and "```" not in sql \
            and "</solution>" not in post:
        a = env.parse_turn(pre + "<sql>" + sql + "</sql>" + post, "tags")
        assert (a.kind, a.arg) == ("sql", sql.strip())


# -----------------------------------------------------------------------------
# observations and steps

def test_observation_strings_exactly_skyrl():
    cfg = EnvConfig()
    err = env.SqlResult(False, error="no such table: x")
    assert env.format_observation(err, 3, cfg) == ("\n\n<observation>Error executing SQL: no such table: x\n"
                                                  "<reminder>You have 3 turns left to complete the task.</reminder>"
                                                  "</observation>\n\n")
    assert "<observation>SQL Timeout\n" in env.format_observation(env.SqlResult(False, timed_out=True), 1, cfg)
    ok = env.SqlResult(True, [(1, "a"), (None, "b\nc")], ["n", "s"])
    assert env.format_observation(ok, 2, cfg).startswith("\n\n<observation>n | s\n1 | a\nNULL | b c\n<reminder>")
    cfg.obs_template, cfg.error_text = "[{result}|{turns_left}]", "E: {error}"
    assert env.format_observation(err, 0, cfg) == "[E: no such table: x|0]"


def test_observation_truncation():
    cfg = EnvConfig()
    rows = [(i, "x" * 100) for i in range(1000)]  # ~105 KB > 9000 chars
    text = env.format_observation(env.SqlResult(True, rows, ["i", "s"]), 1, cfg)
    assert "Truncated to 50 of 1000 rows" in text and "\n49 | " in text and "\n50 | " not in text
    fetched = env.format_observation(env.SqlResult(True, rows[:5], ["i", "s"], truncated=True), 1, cfg)
    assert "first 5 rows were fetched" in fetched
    huge = env.format_observation(env.SqlResult(True, [("y" * 50_000,)], ["s"]), 1, cfg)
    assert len(huge) < cfg.max_obs_chars + 500 and "cut at 9000 characters" in huge
    empty = env.format_observation(env.SqlResult(True, [], ["a"]), 1, cfg)
    assert "(0 rows)" in empty
    capped = env.format_observation(env.SqlResult(True, rows[:30], ["i", "s"]), 1, cfg, row_cap=20)
    assert "first 20 of 30 rows" in capped and "\n19 | " in capped and "\n20 | " not in capped


def test_step_batch_tags(tiny_db):
    cfg = EnvConfig(tool_timeout_s=T)
    texts = ["<think>a</think><sql>SELECT count(*) FROM singer</sql>", "<think>b</think>",
             "<think>c</think><solution>SELECT 1</solution>", "<sql>SELECT 1</sql>",
             "<sql>SELECT * FROM nope</sql>"]
    out = env.step_batch([tiny_db] * 5, texts, [4, 4, 4, 0, 2], cfg)
    assert out[0].observation.startswith("\n\n<observation>count(*)\n60\n<reminder>You have 4 turns")
    assert not out[0].done and out[0].result.rows == [(60,)]
    assert cfg.invalid_text in out[1].observation and not out[1].done
    assert out[2].done and out[2].observation == "" and out[2].action.arg == "SELECT 1"
    assert out[3].done and out[3].observation == ""  # no turns left: the episode ends
    assert "Error executing SQL: no such table: nope" in out[4].observation


def test_step_batch_actions(tiny_db):
    cfg = EnvConfig(protocol="actions", tool_timeout_s=T)
    texts = ["<action>DESCRIBE Singer</action>", "<action>SAMPLE singer</action>",
             "<action>QUERY SELECT id FROM singer</action>", "<action>DESCRIBE nope</action>",
             "<action>ANSWER SELECT 1</action>", "<action>QUERY DELETE FROM singer</action>"]
    out = env.step_batch([tiny_db] * 6, texts, [5] * 6, cfg)
    assert "CREATE TABLE singer" in out[0].observation
    assert out[1].observation.count(" | s") == 5  # LIMIT 5
    assert "first 20 of 60 rows" in out[2].observation
    assert "no table named 'nope'" in out[3].observation and "bad, singer" in out[3].observation
    assert out[4].done and out[4].action.kind == "answer"
    assert "only SELECT queries are allowed" in out[5].observation
    rec = env.step_record(out[2])
    assert rec["kind"] == "query" and rec["ok"] and len(rec["rows"]) == 60
    assert env.table_names_text(tiny_db) == "Tables: bad, singer"
    assert env.STOP_STRINGS["actions"] == ["</action>"] and env.STOP_STRINGS["tags"] == ["</sql>", "</solution>"]


def table_rows(observation: str) -> list[str]:
    """The data rows of a one-column table observation (after its header `id`)."""
    body = observation.split("<observation>", 1)[1].split("\n<reminder>", 1)[0]
    lines = body.splitlines()
    return lines[lines.index("id") + 1:]


def test_describe_columns_puts_every_column_type_and_key_on_one_line(tmp_path):
    """env.describe=columns: names and types in the table's order, its primary and foreign keys, as
    SQLite's own PRAGMA table_info / foreign_key_list report them, on one line; the stored DDL (the
    default) is returned as written."""
    db = tmp_path / "shop.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE maker (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute('CREATE TABLE "Item" (sku TEXT NOT NULL DEFAULT \'\', price REAL, maker_id INTEGER, '
                "PRIMARY KEY (sku), FOREIGN KEY (maker_id) REFERENCES maker (id))")
    con.commit()
    info = con.execute("PRAGMA table_info('Item')").fetchall()  # (cid, name, type, notnull, default, pk)
    fks = con.execute("PRAGMA foreign_key_list('Item')").fetchall()  # (id, seq, table, from, to, ...)
    con.close()
    columns = ", ".join(f"{name} {type_}" for _, name, type_, *_ in info)
    keys = [f"PRIMARY KEY ({', '.join(r[1] for r in info if r[5])})"]
    keys += [f"FOREIGN KEY ({f[3]}) REFERENCES {f[2]} ({f[4]})" for f in fks]
    cfg = EnvConfig(protocol="actions", tool_timeout_s=T, describe="columns", obs_template="[{result}]")
    out = env.step_batch([db, db], ["<action>DESCRIBE item</action>", "<action>DESCRIBE nope</action>"], [3, 3], cfg)
    assert out[0].observation == f"[Item({columns}; {'; '.join(keys)})]"
    assert out[0].observation == "[Item(sku TEXT, price REAL, maker_id INTEGER; PRIMARY KEY (sku); " \
                                 "FOREIGN KEY (maker_id) REFERENCES maker (id))]"
    assert "no table named 'nope'" in out[1].observation and not out[1].done
    cfg.describe = "ddl"
    ddl, = env.step_batch([db], ["<action>DESCRIBE Item</action>"], [3], cfg)
    assert ddl.observation.startswith('[CREATE TABLE "Item" (sku TEXT NOT NULL DEFAULT')


def test_actions_row_limits_at_their_boundaries(tiny_db):
    """The actions protocol's own row limits, from its config: QUERY shows at most
    env.actions_max_result_rows rows (exactly that many: all, no note; one more: the first that many
    and a note with the count, "or more" past env.fetch_rows), SAMPLE shows env.sample_rows rows (its
    own LIMIT, not the QUERY cap), and the tags protocol's <sql> has no row cap."""
    cfg = EnvConfig(protocol="actions", tool_timeout_s=T, actions_max_result_rows=7, sample_rows=9, fetch_rows=30)
    texts = ["<action>QUERY SELECT id FROM singer LIMIT 7</action>",
             "<action>QUERY SELECT id FROM singer LIMIT 8</action>",
             "<action>QUERY SELECT id FROM singer</action>", "<action>SAMPLE singer</action>"]
    exact, one_more, past_fetch, sample = env.step_batch([tiny_db] * 4, texts, [3] * 4, cfg)
    assert table_rows(exact.observation) == [str(i) for i in range(7)] and "Showing" not in exact.observation
    assert table_rows(one_more.observation) == [str(i) for i in range(7)]
    assert "Showing the first 7 of 8 rows." in one_more.observation
    assert "Showing the first 7 of 30 or more rows." in past_fetch.observation
    assert len(table_rows(past_fetch.observation)) == 7 and len(past_fetch.result.rows) == 30  # fetched: 30
    assert sample.observation.count(" | s") == 9 and "Showing" not in sample.observation
    tags = env.step_batch([tiny_db], ["<sql>SELECT id FROM singer</sql>"], [3], EnvConfig(tool_timeout_s=T))[0]
    assert table_rows(tags.observation) == [str(i) for i in range(60)]


def test_a_fresh_pool_boots_before_the_first_deadline_starts(tiny_db):
    """A new process's first query must not spend its deadline waiting for the worker processes to
    boot: a resumed run starts a fresh pool at its first tool call, the straight run had booted its
    pool during the warm start, and under load a boot can take seconds — the same query would time
    out in one run and not in the other (resume would no longer be exact)."""
    sandbox.shutdown_pool()
    # ~4 ms of work under a 0.1 s deadline; a boot alone takes ~0.08 s on an idle 2-core machine
    # (seconds under load), which used to count against it
    count = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000) SELECT count(*) FROM c"
    r = env.run_sql(tiny_db, count, timeout_s=0.1)
    assert r.ok and r.rows == [(20000,)], r
    assert all(w.ready for w in sandbox.get_pool().workers)
