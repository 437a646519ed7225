"""Execution match: does a predicted query return the gold query's result? (reward.py's verdict,
eval.py score's, the dataset's gold check.)

Modes of execution_match:
  set     frozenset(pred rows) == frozenset(gold rows)  (SkyRL, BIRD; 1 == 1.0; column order matters)
  bag     the same as multisets
  spider  the test-suite evaluator's exec match (taoyds/test-suite-sql-eval, default settings):
          '> =' -> '>=' etc., YEAR(CURDATE()) -> 2020, every DISTINCT token removed from both
          (also count(DISTINCT x) -> count( x)) and only the first statement kept, unless
          keep_distinct; row order compared only when the gold contains 'order by'; otherwise
          bags; a column permutation may align the results; exact values; two empty results equal.
All SQL runs through sandbox.run_sql_batch (the sandboxed pool) with the reward timeout (30 s default,
separate from the tool's 5 s). Gold results are cached per process (an LRU bounded by entries and rows).

    python reward.py DB.sqlite "PRED SQL" "GOLD SQL" [set|bag|spider]      # one verdict
Tests: .venv/bin/pytest tests/test_reward.py tests/test_eval_score.py
"""
from __future__ import annotations

import collections
import re

from sqltask import sandbox

REWARD_MAX_ROWS = 1_000_000  # fetch (almost) everything; the sandbox's byte cap still bounds memory


class GoldCache:
    """LRU of gold results, (db_path, prepared gold) -> SqlResult, bounded by entries and by rows
    held in total, so a long run over many databases (or golds returning ~1M rows) cannot grow
    memory without limit. A result larger than max_rows alone is not kept (it is re-run)."""

    def __init__(self, max_entries: int = 20_000, max_rows: int = 5_000_000):
        self.max_entries, self.max_rows = max_entries, max_rows
        self.items: collections.OrderedDict = collections.OrderedDict()
        self.rows = 0

    def __contains__(self, key) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key):
        r = self.items.get(key)
        if r is not None:
            self.items.move_to_end(key)
        return r

    def __setitem__(self, key, r: sandbox.SqlResult):
        if key in self.items:
            self.rows -= len(self.items.pop(key).rows)
        if len(r.rows) > self.max_rows:
            return
        self.items[key] = r
        self.rows += len(r.rows)
        while len(self.items) > self.max_entries or self.rows > self.max_rows:
            _, old = self.items.popitem(last=False)
            self.rows -= len(old.rows)


_GOLD = GoldCache()
_CUR_YEAR = re.compile(r"YEAR\s*\(\s*CURDATE\s*\(\s*\)\s*\)\s*", re.I)  # the evaluator's rewrite

# -----------------------------------------------------------------------------
# the official evaluator's text handling (spider mode)


def spider_sql(sql: str, keep_distinct: bool = False) -> str:
    """What the test-suite evaluator actually executes for a query."""
    sql = sql.replace("> =", ">=").replace("< =", "<=").replace("! =", "!=")
    sql = _CUR_YEAR.sub("2020", sql)
    if keep_distinct:
        return sql
    kept = []
    for t in sandbox.sql_tokens(sql):
        if t.lower() == "distinct":
            continue
        kept.append(t)
        if t == ";":  # the evaluator keeps only the first statement (sqlparse.parse(s)[0])
            break
    return "".join(kept)


# -----------------------------------------------------------------------------
# comparing two results


def _official_key(v) -> str:
    return str(v) + str(type(v))


def _spider_eq(gold: list, pred: list, order_matters: bool) -> bool:
    if not gold and not pred:
        return True
    if len(gold) != len(pred) or len(gold[0]) != len(pred[0]):
        return False
    # Necessary condition first, with the evaluator's own in-row sort key (str(v) + str(type(v))):
    # it also reproduces its verdict when ints and floats sort differently (1 vs 1.0 vs 1.5).
    g_un = [tuple(sorted(r, key=_official_key)) for r in gold]
    p_un = [tuple(sorted(r, key=_official_key)) for r in pred]
    if (g_un != p_un) if order_matters else (set(g_un) != set(p_un)):
        return False
    # Search a column permutation perm (gold column i <- pred column perm[i]). Candidates are
    # pred columns with the same values as gold column i (same list if ordered, same bag
    # otherwise): a necessary condition, so the answer equals trying every permutation as the
    # evaluator does (it prunes with sampled rows); identical pred columns are tried once.
    n = len(gold[0])
    gcols, pcols = list(zip(*gold)), list(zip(*pred))
    same = (lambda a, b: a == b) if order_matters else (lambda a, b: collections.Counter(a) == collections.Counter(b))
    cands = [[j for j in range(n) if same(gcols[i], pcols[j])] for i in range(n)]
    first = {}
    rep = [first.setdefault(pcols[j], j) for j in range(n)]  # representative of identical columns
    gold_bag = None if order_matters else collections.Counter(map(tuple, gold))
    perm, used = [], set()

    def search(i: int) -> bool:
        nonlocal gold_bag
        if i == n:
            rows = [tuple(r[j] for j in perm) for r in pred]
            return rows == [tuple(r) for r in gold] if order_matters else collections.Counter(rows) == gold_bag
        tried = set()
        for j in cands[i]:
            if j in used or rep[j] in tried:
                continue
            tried.add(rep[j])
            perm.append(j), used.add(j)
            if search(i + 1):
                return True
            perm.pop(), used.discard(j)
        return False

    return search(0)


def results_match(gold: list, pred: list, mode: str = "set", order_matters: bool = False) -> bool:
    """Compare two row lists (lists of tuples) under a mode (see the module docstring)."""
    if mode == "set":
        return frozenset(map(tuple, pred)) == frozenset(map(tuple, gold))
    if mode == "bag":
        return collections.Counter(map(tuple, pred)) == collections.Counter(map(tuple, gold))
    assert mode == "spider", mode
    return _spider_eq(gold, pred, order_matters)


# -----------------------------------------------------------------------------
# execution match (batched; gold cached)


def match_batch(items, mode: str = "set", *, timeout_s: float = 30.0, keep_distinct: bool = False,
                workers: int = 0) -> list[tuple[bool, str]]:
    """items: [(db_path, pred_sql, gold_sql)] -> [(match, error text)]; all SQL in one pool call."""
    prep = (lambda s: spider_sql(s, keep_distinct)) if mode == "spider" else (lambda s: s)
    golds = [(str(db), prep(g)) for db, _, g in items]
    preds = [prep(p) if p and p.strip() else "" for _, p, _ in items]
    cached = {k: _GOLD.get(k) for k in set(golds) if k in _GOLD}  # held here: the LRU may evict below
    todo = sorted({k for k in golds if k not in cached})
    jobs = todo + [(db, p) for (db, _), p in zip(golds, preds) if p]
    res = sandbox.run_sql_batch(jobs, timeout_s=timeout_s, max_rows=REWARD_MAX_ROWS, workers=workers)
    for k, r in zip(todo, res):
        if not r.timed_out:  # a timeout may be load; try again next time
            _GOLD[k] = r
    pres = iter(res[len(todo):])
    gold_now = {**cached, **dict(zip(todo, res))}
    out = []
    for (db, g), p in zip(golds, preds):
        gr = gold_now[(db, g)]
        pr = next(pres) if p else None
        if not gr.ok:
            out.append((False, f"gold failed: {gr.error}"))
        elif pr is None:
            out.append((False, "empty prediction"))
        elif not pr.ok:
            out.append((False, pr.error))
        else:
            order = mode == "spider" and "order by" in g.lower()  # the evaluator's own test
            ok = results_match(gr.rows, pr.rows, mode, order)
            note = "result truncated" if (gr.truncated or pr.truncated) else ""
            out.append((ok, note))
    return out


def execution_match(db_path, pred_sql: str, gold_sql: str, mode: str = "set", *, timeout_s: float = 30.0,
                    keep_distinct: bool = False) -> tuple[bool, str]:
    return match_batch([(db_path, pred_sql, gold_sql)], mode, timeout_s=timeout_s, keep_distinct=keep_distinct)[0]


def gold_rows(db_path, gold_sql: str, mode: str = "set", keep_distinct: bool = False) -> list | None:
    """Cached gold rows (after match_batch ran it), or None."""
    g = spider_sql(gold_sql, keep_distinct) if mode == "spider" else gold_sql
    r = _GOLD.get((str(db_path), g))
    return r.rows if r is not None and r.ok else None
