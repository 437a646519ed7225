"""Per-query overhead of the SQL tool (sqltask/sandbox.py) beyond SQLite's own time.

Queries: the executable Spider dev golds (or, without Spider, cheap queries on a generated
database). For each query, in one process, the best of `--repeats` timings of:
  raw    plain cached sqlite3 connection, execute + fetchall (SQLite's own time)
  local  sandbox.run_sql_local: a (reused) hardened connection, progress handler, fetchmany, in-process
  pool   sandbox.run_sql: the same in a worker process, one call at a time (the IPC round trip)
and one sandbox.run_sql_batch over all queries (throughput over all workers).
The headline is the median over queries of (pool - raw), in ms.

    .venv/bin/python bench/sql_tool.py [--repeats 3] [--limit 0]
"""
import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sqltask import sandbox  # noqa: E402

SPIDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "spider")


def spider_jobs():
    path = os.path.join(SPIDER, "dev_gold.sql")
    if not os.path.exists(path):
        return None
    jobs = []
    for line in open(path):
        sql, db = line.rstrip("\n").split("\t")
        p = os.path.join(SPIDER, "database", db, db + ".sqlite")
        if os.path.exists(p):
            jobs.append((p, sql))
    return jobs


def synthetic_jobs():
    p = os.path.join(tempfile.mkdtemp(prefix="bench_sql_"), "t.sqlite")
    c = sqlite3.connect(p)
    c.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, g INT, name TEXT)")
    c.executemany("INSERT INTO t VALUES (?,?,?)", [(i, i % 7, f"n{i}") for i in range(2000)])
    c.commit()
    c.close()
    qs = ["SELECT count(*) FROM t", "SELECT g, count(*) FROM t GROUP BY g", "SELECT name FROM t WHERE id < 20",
          "SELECT max(id) FROM t WHERE g = 3", "SELECT * FROM t ORDER BY name LIMIT 5"]
    return [(p, q) for q in qs * 100]


def best(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N queries (0 = all)")
    a = ap.parse_args()
    jobs = spider_jobs()
    source = "Spider dev golds"
    if jobs is None:
        jobs, source = synthetic_jobs(), "synthetic queries (Spider not found)"
    if a.limit:
        jobs = jobs[:a.limit]
    print(f"{len(jobs)} {source}; {os.cpu_count()} cores; SQLite {sqlite3.sqlite_version}")

    conns = {}

    def raw(db, sql):
        c = conns.get(db) or conns.setdefault(db, sqlite3.connect(f"file:{db}?mode=ro", uri=True))
        c.execute(sql).fetchall()

    sandbox.run_sql_batch(jobs[:50], timeout_s=30)  # start the pool and warm the page cache
    t_raw, t_local, t_pool = [], [], []
    for db, sql in jobs:
        t_raw.append(best(lambda: raw(db, sql), a.repeats))
        t_local.append(best(lambda: sandbox.run_sql_local(db, sql, 30.0), a.repeats))
        t_pool.append(best(lambda: sandbox.run_sql(db, sql, timeout_s=30.0), a.repeats))
    t0 = time.perf_counter()
    res = sandbox.run_sql_batch(jobs, timeout_s=30.0)
    t_batch = time.perf_counter() - t0
    assert all(r.ok for r in res), [r.error for r in res if not r.ok][:3]

    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    over_local = [b - r for b, r in zip(t_local, t_raw)]
    over_pool = [b - r for b, r in zip(t_pool, t_raw)]
    print(f"median per query: raw {ms(t_raw):.3f} ms, local {ms(t_local):.3f} ms, pool {ms(t_pool):.3f} ms")
    print(f"median overhead beyond SQLite: local {ms(over_local):.3f} ms, pool {ms(over_pool):.3f} ms "
          f"(p90 pool {1000 * sorted(over_pool)[int(0.9 * len(over_pool))]:.3f} ms)")
    print(f"ratio pool/raw (medians): {statistics.median(t_pool) / statistics.median(t_raw):.2f}x; "
          f"total raw {sum(t_raw):.2f} s vs one-at-a-time pool {sum(t_pool):.2f} s")
    n = sandbox.get_pool().n
    print(f"batch of {len(jobs)} over {n} workers: {t_batch:.2f} s = {1000 * t_batch / len(jobs):.3f} ms/query "
          f"(raw sequential {sum(t_raw):.2f} s; speed-up {sum(t_raw) / t_batch:.2f}x)")
    print(f"sql_tool_overhead_ms: {ms(over_pool):.3f}")


if __name__ == "__main__":
    main()
