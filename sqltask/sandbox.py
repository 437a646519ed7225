"""Sandboxed SQLite execution: hardened read-only connections and a killable worker-process pool.

Sandbox: read-only immutable URI; an authorizer that allows only SELECT, READ,
FUNCTION, RECURSIVE; ATTACH limit 0 (also stops VACUUM INTO); 4 MB length limit (randomblob(8e8)
fails at once); temp_store=MEMORY (no temp files); a progress-handler deadline; row and byte caps
on fetching; invalid UTF-8 decoded with replacement; one statement per call.
Pool: persistent 'spawn' worker processes (all cores) with RLIMIT_AS and SQLite's heap limit; a
worker past timeout + KILL_MARGIN_S (a single long opcode the progress handler cannot stop) is
killed and replaced. run_sql also goes through the pool (~0.15 ms a query) for that reason.
Workers import only this module (no torch, no yaml).

    from sqltask.sandbox import run_sql, run_sql_batch
    r = run_sql("db.sqlite", "SELECT count(*) FROM t", timeout_s=5.0)  # -> SqlResult

env.py builds the tool protocol on top of this. Tests: .venv/bin/pytest tests/test_env.py
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import multiprocessing as mp
import os
import re
import signal
import sqlite3
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from urllib.parse import quote

LENGTH_LIMIT = 4_000_000  # max bytes of any string/blob/row: randomblob(8e8) fails at once
SQL_LENGTH_LIMIT = 100_000  # max length of the SQL text itself (a model turn is ~12 KB at most)
MAX_RESULT_BYTES = 64_000_000  # rough cap on fetched cell bytes (rows are also capped by max_rows)
INTERRUPT_RESERVE_S = 0.05  # the progress handler stops a query this long before its deadline (IPC)
KILL_MARGIN_S = 0.3  # hard wall budget = timeout + this; past it the worker is killed
PIPELINE = 2  # jobs queued per worker
CLEANUP_MAX_S = 5.0  # a worker still freeing memory this long after a timeout is replaced
WORKER_MEM_MB = 2048  # RLIMIT_AS headroom per worker above its start-up size

# -----------------------------------------------------------------------------
# SQL text helpers (a small lexer: strings, quoted names, comments, words, punctuation)

_TOKEN = re.compile(r"""'(?:[^']|'')*'? | "(?:[^"]|"")*"? | `(?:[^`]|``)*`? | \[[^\]]*\]?
    | --[^\n]* | /\*.*?(?:\*/|\Z) | \w+ | \s+ | .""", re.S | re.X)


def sql_tokens(sql: str) -> list[str]:
    """Tokens whose concatenation is `sql` exactly; an unterminated string runs to the end."""
    return _TOKEN.findall(sql)


def trim_sql(sql: str) -> str:
    """Drop leading/trailing whitespace, comments and semicolons (`SELECT 1;;` runs as one)."""
    toks = sql_tokens(sql)
    skip = lambda t: t.isspace() or t == ";" or t.startswith(("--", "/*"))  # noqa: E731
    while toks and skip(toks[-1]):
        toks.pop()
    i = next((i for i, t in enumerate(toks) if not skip(t)), len(toks))
    return "".join(toks[i:])


# -----------------------------------------------------------------------------
# sandboxed execution (what a worker runs; also usable in-process as run_sql_local)


@dataclass
class SqlResult:
    ok: bool
    rows: list = field(default_factory=list)  # list[tuple]
    columns: list = field(default_factory=list)  # list[str]
    error: str = ""  # SQLite's message (or ours for timeouts, kills, multi-statements)
    timed_out: bool = False
    truncated: bool = False  # more rows existed than max_rows (or the byte cap)
    elapsed_s: float = 0.0


_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_NOT_QUERIES = set("insert update delete replace upsert create drop alter attach detach pragma vacuum reindex "
                   "analyze begin commit end rollback savepoint release".split())


def _authorize(action, *_):  # a whitelist: writes, ATTACH, PRAGMA, temp objects, VACUUM... are denied
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def _connect(db_path: str) -> sqlite3.Connection:
    # immutable=1: no locks, no journal/WAL lookups, nothing is ever written beside the file
    uri = f"file:{quote(os.path.abspath(db_path))}?mode=ro&immutable=1"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    conn.text_factory = lambda b: b.decode("utf-8", "replace")  # Spider's wta_1 has invalid UTF-8
    conn.execute("PRAGMA temp_store=MEMORY")  # before the authorizer, which denies every PRAGMA
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)  # no ATTACH, no VACUUM INTO (it attaches)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, LENGTH_LIMIT)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, SQL_LENGTH_LIMIT)
    conn.set_authorizer(_authorize)
    return conn


_CONNS: collections.OrderedDict = collections.OrderedDict()  # reused hardened connections (LRU)
MAX_CONNS = 16  # nothing a query can do persists in a connection (the authorizer allows reads only)


def _cached_connection(db_path: str):
    st = os.stat(db_path)  # a replaced or rewritten file gets a fresh connection
    key = (os.path.abspath(db_path), st.st_ino, st.st_size, st.st_mtime_ns, threading.get_ident())
    conn = _CONNS.pop(key, None) or _connect(db_path)
    _CONNS[key] = conn
    while len(_CONNS) > MAX_CONNS:
        _CONNS.popitem(last=False)[1].close()
    return key, conn


def run_sql_local(db_path: str, sql: str, timeout_s: float = 5.0, max_rows: int = 10000,
                  on_timeout=None) -> SqlResult:
    """The hardened execution in this process. A progress handler (every 1000 VM steps) enforces
    the deadline; it cannot stop a single long opcode: only the pool's kill can (run_sql).
    on_timeout(elapsed_s) is called once when the deadline passes, before SQLite's clean-up (freeing
    a big in-memory sort takes ~0.3 s): the pool's workers answer from there."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + max(timeout_s - INTERRUPT_RESERVE_S, timeout_s / 2)
    if not isinstance(sql, str) or len(sql) > SQL_LENGTH_LIMIT:  # (also keeps trim_sql's lexing cheap)
        return SqlResult(False, error="SQL must be a string of at most 100 KB", elapsed_s=0.0)
    sql = trim_sql(sql)
    if not sql:
        return SqlResult(False, error="empty SQL statement", elapsed_s=time.perf_counter() - t0)
    first = sql.split(None, 1)[0].split("(", 1)[0].lower()
    if first in _NOT_QUERIES:  # the authorizer denies these anyway; this also stops no-ops that
        # need no authorization (REINDEX of an index-less db) with one clear message
        return SqlResult(False, error=f"only SELECT queries are allowed (got {first[:20].upper()})",
                         elapsed_s=time.perf_counter() - t0)
    key = cur = None
    try:
        if not os.path.isfile(db_path):  # mode=ro never creates a file; say clearly what is wrong
            raise sqlite3.OperationalError(f"no such database file: {db_path}")
        key, conn = _cached_connection(db_path)
        fired = False

        def progress():
            nonlocal fired
            if time.monotonic() <= deadline:
                return 0
            if on_timeout is not None and not fired:
                fired = True
                on_timeout(time.perf_counter() - t0)
            return 1

        conn.set_progress_handler(progress, 1000)
        cur = conn.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        rows, nbytes, truncated, chunk = [], 0, False, 16
        while not truncated:
            batch = cur.fetchmany(chunk)
            if not batch:
                break
            for r in batch:  # stop at max_rows rows or MAX_RESULT_BYTES (cells can be 4 MB each)
                if len(rows) >= max_rows or nbytes > MAX_RESULT_BYTES:
                    truncated = True
                    break
                rows.append(r)
                nbytes += sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in r)
            chunk = 512 if nbytes < 1000 * len(rows) else 1  # big rows: fetch one at a time
        return SqlResult(True, rows, cols, truncated=truncated, elapsed_s=time.perf_counter() - t0)
    except (sqlite3.Error, sqlite3.Warning, MemoryError, OverflowError, ValueError) as e:
        msg = str(e) or type(e).__name__
        timed_out = "interrupt" in msg and time.monotonic() > deadline
        if isinstance(e, MemoryError):
            msg = "out of memory"
            if key in _CONNS:  # do not trust a connection that ran out of memory
                _CONNS.pop(key).close()
        elif "one statement at a time" in msg:
            msg = "only one SQL statement per call is allowed (" + msg + ")"
        elif timed_out:
            msg = "interrupted: query timed out"
        return SqlResult(False, error=msg, timed_out=timed_out, elapsed_s=time.perf_counter() - t0)
    finally:
        if cur is not None:
            cur.close()  # no statement stays active between queries


# -----------------------------------------------------------------------------
# the worker-process pool


def _worker_main(conn, mem_mb: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    try:  # memory cap: headroom above what the interpreter already maps
        import resource
        with open("/proc/self/statm") as fh:
            vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + mem_mb * 2**20, vm + mem_mb * 2**20))
        # SQLite's own allocations fail cleanly ("out of memory") well before the process limit
        c = sqlite3.connect(":memory:")
        c.execute(f"PRAGMA hard_heap_limit={mem_mb * 2**19}")  # process-wide: half the headroom
        c.close()
    except (OSError, ValueError, ImportError, sqlite3.Error):
        pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if job is None:
            return
        early = []  # answer a timeout at once; SQLite's clean-up runs after, then we say "idle"

        def on_timeout(elapsed):
            conn.send(("result", (False, [], [], "interrupted: query timed out", True, False, elapsed), True))
            early.append(1)
        try:
            r = run_sql_local(*job, on_timeout=on_timeout)
        except Exception as e:  # never let one query take the worker down
            r = SqlResult(False, error=f"{type(e).__name__}: {e}")
        if early:
            conn.send(("idle",))
            continue
        try:
            conn.send(("result", (r.ok, r.rows, r.columns, r.error, r.timed_out, r.truncated, r.elapsed_s), False))
        except MemoryError:  # pickling a large result under the memory cap
            conn.send(("result", (False, [], [], "out of memory returning the result", False, False, r.elapsed_s),
                       False))


class _Worker:
    def __init__(self, ctx, mem_mb):
        from sqltask import sandbox  # the target must be picklable by name even if this is __main__
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=sandbox._worker_main, args=(child, mem_mb), daemon=True)
        # spawn re-imports the parent's __main__ in each child (train.py would pull torch into every
        # worker); a stub __main__ without __file__/__spec__ during start() makes it import nothing
        main, sys.modules["__main__"] = sys.modules.get("__main__"), types.ModuleType("__main__")
        try:
            self.proc.start()
        finally:
            sys.modules["__main__"] = main
        child.close()
        self.ready = False  # sent its ("ready", pid) hello
        self.queue = collections.deque()  # indices of the jobs sent to it; queue[0] is running
        self.t0 = 0.0  # when queue[0] started, or when the clean-up began
        self.cleaning = False  # answered a timeout, still freeing SQLite's memory: until "idle"


class SqlPool:
    """Persistent worker processes ('spawn' context: safe under torchrun, pytest and threads).
    Each worker has up to PIPELINE jobs queued, so the next query is there when one ends."""

    def __init__(self, workers: int = 0, mem_mb: int = WORKER_MEM_MB, kill_margin_s: float = KILL_MARGIN_S):
        self.n = workers or default_workers()
        self.mem_mb, self.margin, self.pid = mem_mb, kill_margin_s, os.getpid()
        self.ctx = mp.get_context("spawn")
        self.lock = threading.Lock()
        self.workers = [_Worker(self.ctx, mem_mb) for _ in range(self.n)]
        self.replaced = 0  # workers killed or lost so far (for tests and logs)

    def _replace(self, i: int) -> None:
        w = self.workers[i]
        w.proc.kill()
        w.proc.join(1.0)
        w.conn.close()
        self.workers[i] = _Worker(self.ctx, self.mem_mb)
        self.replaced += 1

    def wait_ready(self, timeout_s: float = 60.0) -> "SqlPool":
        """Block until every worker has booted (before timing something, or at a run's start)."""
        with self.lock:
            end = time.monotonic() + timeout_s
            while not all(w.ready for w in self.workers) and time.monotonic() < end:
                booting = {w.conn: w for w in self.workers if not w.ready}
                for c in mp_wait(list(booting), max(0.0, end - time.monotonic())):
                    try:
                        booting[c].ready = c.recv()[0] == "ready"
                    except (EOFError, OSError):
                        raise RuntimeError("an SQL worker process failed to start") from None
        return self

    def run(self, jobs, timeout_s: float, max_rows: int) -> list[SqlResult]:
        """jobs: [(db_path, sql)] -> results in the same order."""
        with self.lock:
            try:
                return self._run(jobs, timeout_s, max_rows)
            except BaseException:  # e.g. Ctrl-C: a busy worker would answer the next batch
                for i, w in enumerate(self.workers):
                    if w.queue or w.cleaning:
                        self._replace(i)
                raise

    def _run(self, jobs, timeout_s, max_rows):
        results: list = [None] * len(jobs)
        todo = collections.deque(range(len(jobs)))
        left, budget, t_call, heads = len(jobs), timeout_s + self.margin, time.monotonic(), 0

        def lose(i, w, head_result=None):  # replace worker i; its running job gets head_result,
            nonlocal left  # the ones queued behind it go back to todo
            if w.queue and head_result is not None:
                results[w.queue.popleft()], left = head_result, left - 1
            todo.extendleft(reversed(w.queue))
            self._replace(i)

        while left:
            for d, i in [(d, i) for d in range(PIPELINE) for i in range(self.n)]:
                w = self.workers[i]  # keep every booted worker's queue full, breadth first
                if not (w.ready and todo and len(w.queue) <= d):
                    continue
                now, j = time.monotonic(), todo.popleft()
                t = timeout_s
                if not w.queue and not w.cleaning:  # it starts now; the call's first n jobs count
                    # from the call (so waiting for booting workers eats their deadline), others from now
                    w.t0, heads = (t_call if heads < self.n else now), heads + 1
                    t = timeout_s - (now - w.t0)
                try:
                    w.conn.send((str(jobs[j][0]), jobs[j][1], max(0.001, t), max_rows))
                    w.queue.append(j)
                except (OSError, ValueError):  # it died while idle: re-queue, replace
                    todo.appendleft(j)
                    lose(i, w)
            busy = [w for w in self.workers if w.queue or w.cleaning or not w.ready]
            ends = [w.t0 + (CLEANUP_MAX_S if w.cleaning else budget) for w in busy if w.ready]
            wait_s = max(0.0, min(ends) - time.monotonic()) if ends else 5.0
            ready = set(mp_wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], wait_s))
            for i, w in enumerate(self.workers):
                now = time.monotonic()
                if w not in busy:
                    continue
                if w.conn in ready or w.proc.sentinel in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):  # died (crash, OOM kill)
                        if not w.ready:
                            raise RuntimeError("an SQL worker process failed to start") from None
                        lose(i, w, SqlResult(False, error="SQL worker process died", elapsed_s=now - w.t0))
                        continue
                    if msg[0] == "ready":
                        w.ready = True
                    elif msg[0] == "idle":  # clean-up done; the next queued job starts now
                        w.cleaning, w.t0 = False, now
                    else:  # ("result", fields, early): the next queued job starts now (or after clean-up)
                        results[w.queue.popleft()], left = SqlResult(*msg[1]), left - 1
                        w.cleaning, w.t0 = msg[2], now
                elif w.cleaning and now > w.t0 + CLEANUP_MAX_S:
                    lose(i, w)
                elif w.queue and not w.cleaning and now > w.t0 + budget:
                    # a single long opcode (or a stuck worker): only a kill stops it
                    lose(i, w, SqlResult(False, error=f"killed: query exceeded {timeout_s:g} s",
                                         timed_out=True, elapsed_s=now - w.t0))
        return results

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(None)  # asks the worker to exit; a busy one is killed
            w.proc.join(0.5)
            w.proc.kill(), w.proc.join(1.0), w.conn.close()
        self.workers = []


def default_workers() -> int:
    """Pool size for workers=0: this machine's cores shared by its ranks (torchrun's
    LOCAL_WORLD_SIZE), so 8 ranks on 64 cores start 8 workers each, not 64."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


_POOL: SqlPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool(workers: int = 0) -> SqlPool:
    """The lazily created module-level pool (re-created after a fork or for another size)."""
    global _POOL
    with _POOL_LOCK:
        n = workers or default_workers()
        if _POOL is not None and _POOL.pid != os.getpid():
            _POOL = None  # inherited through fork: its pipes belong to the parent
        if _POOL is not None and workers and _POOL.n != n:
            _POOL.close()
            _POOL = None
        if _POOL is None:
            # booted before any query's deadline starts: a query's outcome must not depend on how
            # long the OS took to start the workers (a resumed run starts its pool at its first
            # tool call, the straight run during its warm start; under load a boot takes seconds)
            _POOL = SqlPool(n).wait_ready()
        return _POOL


@atexit.register
def shutdown_pool() -> None:
    global _POOL
    if _POOL is not None and _POOL.pid == os.getpid():
        _POOL.close()
    _POOL = None


def run_sql_batch(jobs, *, timeout_s: float = 5.0, max_rows: int = 10000, workers: int = 0) -> list[SqlResult]:
    """Run [(db_path, sql)] across the persistent pool; results in order."""
    return get_pool(workers).run(list(jobs), timeout_s, max_rows) if jobs else []


def run_sql(db_path, sql: str, *, timeout_s: float = 5.0, max_rows: int = 10000) -> SqlResult:
    """One sandboxed query. Goes through the pool (~0.15 ms) rather than in-process, because only a
    process kill stops a single long opcode; use run_sql_local where that risk is acceptable.
    The deadline counts from the call (a new pool has booted first; time spent waiting for a
    worker replaced after a kill counts)."""
    return run_sql_batch([(db_path, sql)], timeout_s=timeout_s, max_rows=max_rows)[0]
