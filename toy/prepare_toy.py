"""The toy text-to-SQL set: the data of the embedded default (a tiny model learns it in minutes).

    python -m toy.prepare_toy --out runs/toy [--seed 0]

Writes, under --out:
    database/<db_id>/<db_id>.sqlite   130 small databases: 5 schema families x 26 (toy/schemas.py)
    train.jsonl                       ~2000 questions on 120 databases (canonical records, sqltask/dataset.py)
    eval.jsonl                        600 questions on the 10 held-out databases (two per family)
Records' db_path is relative to --out. Each record also carries `template` (for per-template EX).

Design: train and eval are split by database, as in Spider, but the schema vocabulary is shared
within a family, so held-out accuracy is reachable for a tiny model that cannot learn to copy
unseen identifiers. Gold SQL is short and canonical (uppercase keywords, single spaces, T1/T2).
Two kinds of question, mixed (~74% need the tool):
  direct     every literal of the gold appears verbatim in the question (the model copies it);
  tool       the question names a category as people say it ("Paris", "pending") but the database
             stores a code ('Paris4k', 'pending7c': a digit and a letter drawn per database, toy/schemas.py)
             beside the code's twin ('Paris_N', 'pending_S': the word followed by letters), and the
             prompt shows no values. The record's `lookup_sql` (SELECT DISTINCT city FROM customers
             WHERE city LIKE 'Paris%') returns the code and its twin; the code is the one whose word
             is followed by a digit. Reading that observation is what makes the final query right:
             no database stores a code another one stores for the word, so a memorised code is
             wrong held-out and seldom right on train; and an answer that matches the word with a
             LIKE pattern ('%Paris%') matches the twin's rows too, so it is wrong (wildcard_shares:
             no tool question is answered by any pattern on the word alone).
  refine     a tool question on the column a database stores behind a prefix ('st_pending7c',
             schemas.code_prefix; one of the two category columns of every database): the
             natural lookup (LIKE 'pending%', the record's `first_lookup_sql`) returns no rows,
             and only a broader one (LIKE '%pending%', its `lookup_sql`) shows the code and its
             twin ('st_pending_S'). Nothing in the prompt says which column is prefixed: the policy
             learns it from the empty observation and looks again (hence env.max_turns 3 in
             configs/tiny.yaml).
Each record carries `template` (per-template EX), `lookup_sql` ("" for direct questions; the
lookup whose observation shows the code) and `first_lookup_sql` ("" unless the natural lookup,
tried before `lookup_sql`, returns no rows).
Every gold is executed here; the script fails if any errors, if a template's results are mostly
empty, if an ORDER BY ... LIMIT gold has a tie at its cut (an ambiguous answer), or if a lookup
does not list exactly the code and its twin.
Same seed -> byte-identical files (seeded by strings, databases written whole then renamed; the
SQLite file format holds no time or path, only the library version, so the .sqlite bytes are equal
for the same SQLite version; tests/test_toy.py checks it).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sqlite3
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from sqltask.dataset import make_record, write_jsonl
from toy.build_lock import build_lock
from toy.schemas import FAMILIES, encode_categories, make_rows, write_db

# 'Paris4k' -> ('Paris', '4k'), 'ci_Paris4k' -> ('Paris', '4k'); a twin ('Paris_N') does not match
CODE = re.compile(r"(?:[a-z]{2}_)?([A-Za-z]+)(\d[a-z])")

# many small databases: with 3 training databases per family the model memorised their codes
# (and wrote them on held-out databases); with 12 it could not, but one database asked ~3
# questions about each of its codes, so the most-seen code still paid on 31% of the training tool
# questions. 24 databases of 17 questions ask about a code about once (chosen least-asked first)
TRAIN_DBS_PER_FAMILY = 24  # <family>_1 .. _24: 120 training databases
TRAIN_PER_DB = 17  # 120 train dbs -> 2040 questions
# held out: <family>_25 .. _26, 10 databases of 60 questions. 600 questions put a held-out EX's
# sampling error near 2 points (p ~ 0.5), and two databases per family keep one database's draw of
# codes and rows from setting the family's score
EVAL_DBS_PER_FAMILY = 2
EVAL_PER_DB = 60
MAX_EMPTY_FRACTION = 0.05  # a template whose golds are emptier than this fails the build
# tool templates come up 13x as often in the round-robin: ~73% of the questions need the lookup, so
# a policy that calls the tool when (and only when) it pays makes ~0.7 tool calls per episode, and
# the warm start sees enough lookups to learn to copy the code from the observation
TOOL_WEIGHT = 13
# bumped whenever the set's layout or codes change: tiny.prepare_assets rebuilds an older set (and
# the tiny model whose tokenizer was trained on it). 2: two-digit codes never reused across databases,
# 25 databases per family with 17 questions each (the memoriser's reward on train 31% -> 11%).
# 3: codes are the word, a digit and a letter ('Paris4k'), each beside a twin ('Paris_N') so that a
# LIKE on the word answers no tool question (v2: all of them); 10 held-out databases, 600 questions
# (was 5, 300)
TOY_VERSION = 3

# -----------------------------------------------------------------------------
# question templates: each returns (question, gold_sql) or None (not applicable here; retried)


def an(w: str) -> str:
    return ("an " if w[:1] in tuple("aeiou") else "a ") + w


def plural(w: str) -> str:
    if w.endswith("y") and w[-2] not in "aeiou":
        return w[:-1] + "ies"
    return w + ("es" if w.endswith("s") else "s")


class Ctx:
    """One database while its questions are generated: family spec, rows, codes, rng, phrasing."""

    def __init__(self, rng, fam, rows, names):
        self.rng, self.fam, self.rows, self.names = rng, fam, rows, names  # {table: {code: (word, twin)}}
        self.P, self.C = fam["parent"], fam["child"]
        self.asked = Counter()  # code -> questions drawn on it in this database

    def table(self, need=None):
        sides = [s for s in ("parent", "child") if need is None or self.fam[s].get(need)]
        s = self.rng.choice(sides)
        return self.fam[s], self.rows[s]

    def say(self, phrasings, t, **kw):
        w = lambda c: t.get("words", {}).get(c, c.replace("_", " "))  # noqa: E731
        words = dict(P=t["plural"], S=t["sing"], L=w(t["label"]), Ls=plural(w(t["label"])),
                     C=w(t["cat"]), Cs=plural(w(t["cat"])), N=w(t["num"]),
                     D=w(t["date"]) if t.get("date") else "")
        words.update(aN=an(words["N"]), aD=an(words["D"]))
        return self.rng.choice(phrasings).format(**words, **kw)

    def vals(self, rows, col):
        return sorted({r[col] for r in rows if r[col] is not None})

    def category(self, t, rs):
        """A stored code of t's categorical column -> (code, the name people say, lookups(...))."""
        codes = [c for c in self.vals(rs, t["cat"]) if c in self.names[t["table"]]]  # not the twins
        fewest = min(self.asked[c] for c in codes)
        code = self.rng.choice([c for c in codes if self.asked[c] == fewest])
        self.asked[code] += 1
        name = self.names[t["table"]][code][0]
        return code, name, lookups(t["table"], t["cat"], name, code)

    def join(self):
        return f"FROM {self.P['table']} T1 JOIN {self.C['table']} T2 ON T1.id = T2.{self.C['fk']}"


def lookup_sql(table: str, column: str, word: str) -> str:
    """The tool turn of a tool question: the column's stored spellings that start with the question's
    word. Its observation is the code ('Paris4k') and its twin ('Paris_N'), each right after the word
    the model just wrote into the query. A listing of the whole column (SELECT DISTINCT city FROM customers) was not
    learnt: after its 4-6 rows the warm start had forgotten which word the question said and
    wrote another row's word (0% held-out EX on tool questions after 300 SFT steps, 10% right word)."""
    return f"SELECT DISTINCT {column} FROM {table} WHERE {column} LIKE '{word}%'"


def lookups(table: str, column: str, word: str, code: str) -> tuple[str, str]:
    """(first_lookup_sql, lookup_sql) of a tool question. A code that starts with the word: ("",
    the natural lookup). A prefixed code ('st_pending7c'): the natural lookup, which returns no
    rows, then the same query with the word anywhere in the code (LIKE '%pending%'), one edit
    from the failed query, whose observation is the code."""
    natural = lookup_sql(table, column, word)
    if code.startswith(word):
        return "", natural
    return natural, natural.replace(f"LIKE '{word}%'", f"LIKE '%{word}%'")


def q(v) -> str:
    return f"'{v}'" if isinstance(v, str) else str(v)


AGG = [("AVG", ["average", "mean"]), ("MAX", ["maximum", "highest"]), ("MIN", ["minimum", "lowest"]),
       ("SUM", ["total"])]
TEMPLATES = {}
TOOL_TEMPLATES = set()  # those whose question names a category: (question, sql, lookup_sql)


def template(fn):
    TEMPLATES[fn.__name__] = fn
    return fn


def tool_template(fn):
    TOOL_TEMPLATES.add(fn.__name__)
    return template(fn)


@template
def count_all(g):
    t, _ = g.table()
    return g.say(["How many {P} are there?", "Count the {P}.", "What is the total number of {P}?"], t), \
        f"SELECT COUNT(*) FROM {t['table']}"


@tool_template
def list_where_cat(g):
    t, rs = g.table()
    code, v, look = g.category(t, rs)
    return g.say(["List the {Ls} of {P} whose {C} is {v}.", "Which {P} have {C} {v}? Give their {Ls}.",
                  "Show the {L} of every {S} with {C} {v}."], t, v=v), \
        f"SELECT {t['label']} FROM {t['table']} WHERE {t['cat']} = {q(code)}", look


@tool_template
def count_where_cat(g):
    t, rs = g.table()
    code, v, look = g.category(t, rs)
    return g.say(["How many {P} have {C} {v}?", "Count the {P} whose {C} is {v}.",
                  "What is the number of {P} with {C} {v}?"], t, v=v), \
        f"SELECT COUNT(*) FROM {t['table']} WHERE {t['cat']} = {q(code)}", look


@template
def list_where_num(g):
    t, rs = g.table()
    v = g.rng.choice(g.vals(rs, t["num"])[1:-1])  # not an extreme: both sides are non-empty
    if g.rng.random() < 0.5:
        return g.say(["List the {Ls} of {P} with {N} greater than {v}.",
                      "Which {P} have {aN} above {v}? Show their {Ls}.", "Give the {L} of each {S} whose {N} is over {v}."],
                     t, v=v), f"SELECT {t['label']} FROM {t['table']} WHERE {t['num']} > {v}"
    return g.say(["List the {Ls} of {P} with {N} less than {v}.", "Which {P} have {aN} below {v}? Show their {Ls}.",
                  "Give the {L} of each {S} whose {N} is under {v}."], t, v=v), \
        f"SELECT {t['label']} FROM {t['table']} WHERE {t['num']} < {v}"


@template
def between(g):
    t, rs = g.table()
    a, b = sorted(g.rng.sample(g.vals(rs, t["num"]), 2))
    return g.say(["List the {Ls} of {P} with {N} between {a} and {b}.",
                  "Which {P} have {aN} from {a} to {b}? Give their {Ls}."], t, a=a, b=b), \
        f"SELECT {t['label']} FROM {t['table']} WHERE {t['num']} BETWEEN {a} AND {b}"


@template
def agg(g):
    t, _ = g.table()
    fn, words = g.rng.choice(AGG)
    return g.say(["What is the {a} {N} of all {P}?", "Find the {a} {N} among {P}.", "Give the {a} {N} of the {P}."],
                 t, a=g.rng.choice(words)), f"SELECT {fn}({t['num']}) FROM {t['table']}"


@tool_template
def agg_where(g):
    t, rs = g.table()
    fn, words = g.rng.choice(AGG)
    code, v, look = g.category(t, rs)
    return g.say(["What is the {a} {N} of {P} whose {C} is {v}?", "Among {P} with {C} {v}, what is the {a} {N}?"],
                 t, a=g.rng.choice(words), v=v), \
        f"SELECT {fn}({t['num']}) FROM {t['table']} WHERE {t['cat']} = {q(code)}", look


@template
def lookup(g):
    t, rs = g.P, g.rows["parent"]  # parent labels are unique
    r = g.rng.choice(rs)
    col = g.rng.choice([c for c in (t["cat"], t["num"], t["date"]) if c and r[c] is not None])
    w = t.get("words", {}).get(col, col)
    return g.say(["What is the {w} of the {S} named {v}?", "Give the {w} of the {S} {v}.", "Find the {w} of {v}."],
                 t, w=w, v=r[t["label"]]), f"SELECT {col} FROM {t['table']} WHERE {t['label']} = {q(r[t['label']])}"


@template
def date_filter(g):
    t, rs = g.table(need="date")
    d = g.rng.choice(g.vals(rs, t["date"])[2:-2])
    if g.rng.random() < 0.5:
        return g.say(["List the {Ls} of {P} with {aD} after {d}.", "Which {P} have {aD} later than {d}? Show their {Ls}."],
                     t, d=d), f"SELECT {t['label']} FROM {t['table']} WHERE {t['date']} > {q(d)}"
    return g.say(["List the {Ls} of {P} with {aD} before {d}.", "Which {P} have {aD} earlier than {d}? Show their {Ls}."],
                 t, d=d), f"SELECT {t['label']} FROM {t['table']} WHERE {t['date']} < {q(d)}"


@template
def null_count(g):
    t, _ = g.table(need="nullable")
    c = t["nullable"]
    w = t.get("words", {}).get(c, c)
    return g.say(["How many {P} have no {w} recorded?", "Count the {P} whose {w} is missing."], t, w=w), \
        f"SELECT COUNT(*) FROM {t['table']} WHERE {c} IS NULL"


@template
def distinct(g):
    t, _ = g.table()
    return g.say(["What are the distinct {Cs} of {P}?", "List the different {Cs} of all {P}.",
                  "Show each {C} of the {P} once."], t), f"SELECT DISTINCT {t['cat']} FROM {t['table']}"


@template
def group_count(g):
    t, _ = g.table()
    return g.say(["How many {P} are there for each {C}?", "For each {C}, count the {P}.",
                  "Show each {C} and its number of {P}."], t), \
        f"SELECT {t['cat']}, COUNT(*) FROM {t['table']} GROUP BY {t['cat']}"


@template
def group_avg(g):
    t, _ = g.table()
    return g.say(["What is the average {N} of {P} for each {C}?", "For each {C}, show the average {N} of {P}."], t), \
        f"SELECT {t['cat']}, AVG({t['num']}) FROM {t['table']} GROUP BY {t['cat']}"


@template
def having(g):
    t, rs = g.table()
    counts = sorted(set(Counter(r[t["cat"]] for r in rs if r[t["cat"]] is not None).values()))
    if len(counts) < 2:
        return None
    k = g.rng.choice(counts[:-1])  # some groups pass, not all
    return g.say(["Which {Cs} have more than {k} {P}?", "List the {Cs} with over {k} {P}."], t, k=k), \
        f"SELECT {t['cat']} FROM {t['table']} GROUP BY {t['cat']} HAVING COUNT(*) > {k}"


def _no_tie(values, k, desc):
    s = sorted(values, reverse=desc)
    return len(s) > k and s[k - 1] != s[k]


@template
def top_k(g):
    t, rs = g.table()
    k, desc = g.rng.randint(2, 4), g.rng.random() < 0.5
    if not _no_tie([r[t["num"]] for r in rs], k, desc):
        return None
    most = ["highest", "largest"] if desc else ["lowest", "smallest"]
    return g.say(["List the {Ls} of the {k} {P} with the {m} {N}.", "Which {k} {P} have the {m} {N}? Give their {Ls}."],
                 t, k=k, m=g.rng.choice(most)), \
        f"SELECT {t['label']} FROM {t['table']} ORDER BY {t['num']} {'DESC' if desc else 'ASC'} LIMIT {k}"


@template
def top_1(g):
    t, rs = g.table()
    desc = g.rng.random() < 0.5
    if not _no_tie([r[t["num"]] for r in rs], 1, desc):
        return None
    most = ["highest", "largest"] if desc else ["lowest", "smallest"]
    return g.say(["What is the {L} of the {S} with the {m} {N}?", "Which {S} has the {m} {N}? Give the {L}."],
                 t, m=g.rng.choice(most)), \
        f"SELECT {t['label']} FROM {t['table']} ORDER BY {t['num']} {'DESC' if desc else 'ASC'} LIMIT 1"


@template
def above_avg(g):
    t, _ = g.table()
    return g.say(["List the {Ls} of {P} whose {N} is above the average.",
                  "Which {P} have {aN} higher than the average {N}? Give their {Ls}."], t), \
        f"SELECT {t['label']} FROM {t['table']} WHERE {t['num']} > (SELECT AVG({t['num']}) FROM {t['table']})"


@template
def join_parent_label(g):
    P, C = g.P, g.C
    with_kids = {r[C["fk"]] for r in g.rows["child"]}
    v = g.rng.choice([r[P["label"]] for r in g.rows["parent"] if r["id"] in with_kids])
    return g.say(["List the {Ls} of {P} {rel} {v}.", "What are the {Ls} of the {P} {rel} {v}?",
                  "Show the {L} of every {S} {rel} {v}."], C, rel=g.fam["rel"], v=v), \
        f"SELECT T2.{C['label']} {g.join()} WHERE T1.{P['label']} = {q(v)}"


@tool_template
def join_parent_cat(g):
    P, C = g.P, g.C
    with_kids = {r[C["fk"]] for r in g.rows["child"]}
    code = g.rng.choice(sorted({r[P["cat"]] for r in g.rows["parent"] if r["id"] in with_kids} & set(g.names[P["table"]])))
    v = g.names[P["table"]][code][0]
    look = lookups(P["table"], P["cat"], v, code)
    pw = P.get("words", {}).get(P["cat"], P["cat"])
    return g.say(["List the {Ls} of {P} {rel} {pp} whose {pw} is {v}.",
                  "Show the {L} of each {S} {rel} a {ps} with {pw} {v}."], C, rel=g.fam["rel"], v=v, pw=pw,
                 pp=P["plural"], ps=P["sing"]), \
        f"SELECT T2.{C['label']} {g.join()} WHERE T1.{P['cat']} = {q(code)}", look


@template
def join_count(g):
    P, C = g.P, g.C
    return g.say(["How many {cp} does each {S} have? Show the {L} and the count.",
                  "For each {S}, give the {L} and the number of {cp}."], P, cp=C["plural"]), \
        f"SELECT T1.{P['label']}, COUNT(*) {g.join()} GROUP BY T1.id"


@template
def join_child_num(g):
    P, C = g.P, g.C
    v = g.rng.choice(g.vals(g.rows["child"], C["num"])[1:-1])
    cw = C.get("words", {}).get(C["num"], C["num"])
    return g.say(["Which {P} have {cp} with {cw} above {v}? List the distinct {Ls}.",
                  "Give the distinct {Ls} of {P} that have {acs} with {cw} over {v}."], P, cp=C["plural"],
                 acs=an(C["sing"]), cw=cw, v=v), \
        f"SELECT DISTINCT T1.{P['label']} {g.join()} WHERE T2.{C['num']} > {v}"


@template
def join_top(g):
    P, C = g.P, g.C
    if not _no_tie(list(Counter(r[C["fk"]] for r in g.rows["child"]).values()), 1, True):
        return None
    return g.say(["Which {S} has the most {cp}? Give the {L}.", "What is the {L} of the {S} with the most {cp}?"],
                 P, cp=C["plural"]), \
        f"SELECT T1.{P['label']} {g.join()} GROUP BY T1.id ORDER BY COUNT(*) DESC LIMIT 1"


@tool_template
def in_subquery(g):
    P, C = g.P, g.C
    code, v, look = g.category(C, g.rows["child"])
    cw = C.get("words", {}).get(C["cat"], C["cat"])
    return g.say(["List the {Ls} of {P} that have at least one {cs} whose {cw} is {v}.",
                  "Which {P} have {acs} with {cw} {v}? Give their {Ls}."], P, cs=C["sing"], acs=an(C["sing"]), cw=cw, v=v), \
        f"SELECT {P['label']} FROM {P['table']} WHERE id IN (SELECT {C['fk']} FROM {C['table']} WHERE {C['cat']} = {q(code)})", \
        look


@template
def not_in(g):
    P, C = g.P, g.C
    return g.say(["Which {P} have no {cp}? Give their {Ls}.", "List the {Ls} of {P} without any {cp}.",
                  "Show the {L} of every {S} that has no {cp}."], P, cp=C["plural"]), \
        f"SELECT {P['label']} FROM {P['table']} WHERE id NOT IN (SELECT {C['fk']} FROM {C['table']})"


# -----------------------------------------------------------------------------
# the shortcut a tool question must not have: a LIKE pattern on the word instead of the looked-up code


def the_code(gold_sql: str) -> str:
    """The one string literal of a tool question's gold: the code ('ci_Paris4k')."""
    (code,) = re.findall(r"'([^']*)'", gold_sql)
    return code


def wildcard_patterns(word: str, prefix: str) -> list[str]:
    """LIKE patterns built from the question's word and the column's code prefix ('ci_') alone: any
    run of wildcards (% or _) before and after the word, with or without the prefix. A policy could
    write one of them without reading a lookup ('%Paris%' matches 'ci_Paris4k')."""
    heads = ["", "%", "_", "__", "___", "%_", prefix, "%" + prefix]
    tails = ["", "%", "_", "__", "___", "%_", "_%"]
    return [h + word + t for h in heads for t in tails]


def wildcard_answer(gold_sql: str, pattern: str) -> str:
    """The gold with its code replaced by a LIKE pattern (`city = 'Paris4k'` -> `city LIKE '%Paris%'`)."""
    return gold_sql.replace(f"= '{the_code(gold_sql)}'", f"LIKE '{pattern}'")


def rows_of(con, sql: str) -> frozenset:
    """A query's rows as the reward compares them (reward.mode set: order and duplicates ignored)."""
    return frozenset(con.execute(sql).fetchall())


def wildcard_right(con, record: dict) -> dict[str, bool]:
    """{pattern: whether the gold with that LIKE pattern instead of the code returns the gold's rows}
    for every wildcard_patterns of a tool question's word."""
    code = the_code(record["gold_sql"])
    word = CODE.fullmatch(code).group(1)
    prefix = code[:code.index(word)]  # 'ci_' or ''
    gold = rows_of(con, record["gold_sql"])
    return {p: rows_of(con, wildcard_answer(record["gold_sql"], p)) == gold for p in wildcard_patterns(word, prefix)}


def wildcard_shares(out_dir, splits=("train", "eval"), every: int = 1) -> dict:
    """{split: {"tool": tool questions, "any": those some wildcard pattern answers right, "best":
    the most any single pattern answers right, "best_pattern": that pattern with the word as WORD
    ("" when none answers any)}} for the toy set at out_dir (its train.jsonl / eval.jsonl), on every
    `every`-th tool question. What a policy that never reads a lookup could earn on the tool
    questions by matching the word (bench/toy_wildcard.py prints it)."""
    out = Path(out_dir)
    shares = {}
    for split in splits:
        recs = [json.loads(line) for line in open(out / f"{split}.jsonl") if line.strip()]
        cons, per_pattern, n_any, n = {}, Counter(), 0, 0
        for r in [r for r in recs if r["lookup_sql"]][::every]:
            if r["db_path"] not in cons:
                cons[r["db_path"]] = sqlite3.connect(f"file:{out / r['db_path']}?mode=ro", uri=True)
            word = CODE.fullmatch(the_code(r["gold_sql"])).group(1)
            right = wildcard_right(cons[r["db_path"]], r)
            for pattern, ok in right.items():
                per_pattern[pattern.replace(word, "WORD")] += ok
            n_any += any(right.values())
            n += 1
        for c in cons.values():
            c.close()
        best, hits = per_pattern.most_common(1)[0] if per_pattern else ("", 0)
        shares[split] = {"tool": n, "any": n_any, "best": hits, "best_pattern": best if hits else ""}
    return shares


# -----------------------------------------------------------------------------
# building the set


def questions(rng: random.Random, fam: dict, rows: dict, names: dict, n: int,
              con: sqlite3.Connection) -> list[tuple[str, str, str, str, str]]:
    """n distinct (template, question, sql, lookup_sql, first_lookup_sql), templates taken
    round-robin so all are covered (tool templates TOOL_WEIGHT times per round, each round
    shuffled); both lookups are "" for direct questions. con: the database, read to leave out a
    tool question whose answer the code's twin does not change (twin_changes_answer)."""
    g, out, seen = Ctx(rng, fam, rows, names), [], set()
    order = [t for t in TEMPLATES for _ in range(TOOL_WEIGHT if t in TOOL_TEMPLATES else 1)]
    i = 0
    while len(out) < n and i < 50 * n:
        if i % len(order) == 0:  # each round in a fresh order: a database with fewer questions than
            rng.shuffle(order)   # a round still gets a fair sample of the templates, not the first ones
        name = order[i % len(order)]
        i += 1
        qs = TEMPLATES[name](g)
        if qs is None or qs[0] in seen or (len(qs) > 2 and not twin_changes_answer(con, qs[1], names)):
            continue
        seen.add(qs[0])
        first, look = qs[2] if len(qs) > 2 else ("", "")
        out.append((name, qs[0], qs[1], look, first))
    return out


def twin_changes_answer(con, gold_sql: str, names: dict) -> bool:
    """Whether a tool question's gold returns other rows once the code's twin is let in
    (`city = 'Paris4k'` -> `city IN ('Paris4k', 'Paris_N')`). Every LIKE pattern on the word alone
    that matches the code matches the twin too (schemas.twin_of), so where the twin's rows change
    nothing (a MAX the code's rows hold, labels its rows repeat) such a pattern would answer the
    question without the lookup: those questions are drawn again."""
    code = the_code(gold_sql)
    twin = next(tw for table in names.values() for c, (_, tw) in table.items() if c == code)
    both = gold_sql.replace(f"= '{code}'", f"IN ('{code}', '{twin}')")
    return rows_of(con, both) != rows_of(con, gold_sql)


def check_golds(out: Path, records: list[dict]) -> Counter:
    """Run every gold read-only; fail on any error or on a template with mostly empty results, if
    a lookup's result is not the code its gold uses and that code's twin, or if a first lookup
    returns rows."""
    empty, total, cons = Counter(), Counter(), {}
    for r in records:
        if r["db_path"] not in cons:
            cons[r["db_path"]] = sqlite3.connect(f"file:{out / r['db_path']}?mode=ro", uri=True)
        try:
            rows = cons[r["db_path"]].execute(r["gold_sql"]).fetchall()
        except sqlite3.Error as e:
            raise AssertionError(f"toy gold fails: {r['gold_sql']!r}: {e}") from None
        if r["lookup_sql"]:  # the lookup lists the code and its twin; the code is the one with a digit
            listed = [row[0] for row in cons[r["db_path"]].execute(r["lookup_sql"]).fetchall()]
            assert len(listed) == 2 and [v for v in listed if CODE.fullmatch(v)] == [the_code(r["gold_sql"])], \
                (r["gold_sql"], listed)
        if r["first_lookup_sql"]:  # the natural lookup a refine question starts with finds nothing
            assert r["lookup_sql"] and not cons[r["db_path"]].execute(r["first_lookup_sql"]).fetchall(), r
        total[r["template"]] += 1
        empty[r["template"]] += not rows or all(v is None for row in rows for v in row)
    for c in cons.values():
        c.close()
    for t, n in total.items():
        assert empty[t] <= MAX_EMPTY_FRACTION * n, f"template {t}: {empty[t]}/{n} golds return nothing"
    return empty


def memoriser_right(splits: dict) -> dict:
    """{split: tool questions whose code is the one training golds use most for the word (prefix
    included)}: what a policy that never looks earns. On train it is reward GRPO can get without
    the tool (with env.max_turns 3 the warm start's two-lookup route earned less, and GRPO dropped
    the tool); held-out databases avoid it (0)."""
    def code(r):
        return re.findall(r"'([^']*)'", r["gold_sql"])[0]
    seen = defaultdict(Counter)  # word -> Counter(code) over the training golds
    for r in splits["train"]:
        if r["lookup_sql"]:
            seen[CODE.fullmatch(code(r)).group(1)][code(r)] += 1
    top = {w: c.most_common(1)[0][0] for w, c in seen.items()}
    return {s: sum(top.get(CODE.fullmatch(code(r)).group(1)) == code(r) for r in recs if r["lookup_sql"])
            for s, recs in splits.items()}


def prepare_toy(out_dir, seed: int = 0, verbose: bool = False) -> dict:
    """Generate the toy set under out_dir. Returns {"train": n, "eval": n, "templates": {split:
    Counter}, "tool": {split: questions that need the tool}, "refine": {split: those whose first
    lookup returns no rows}, "memoriser": {split: tool questions a policy that never looks gets
    right, memoriser_right}}. One process at a time writes a folder (build_lock: another waits)."""
    with build_lock(out_dir):
        return _write_toy(out_dir, seed, verbose)


def _write_toy(out_dir, seed: int, verbose: bool) -> dict:
    out = Path(out_dir)
    splits = {"train": [], "eval": []}
    seen = defaultdict(Counter)  # word -> Counter(suffix) of the codes training golds used so far
    for split in ("train", "eval"):  # training databases first: the held-out ones avoid their codes
        for family, fam in FAMILIES.items():
            for i in (range(1, TRAIN_DBS_PER_FAMILY + 1) if split == "train" else
                      range(TRAIN_DBS_PER_FAMILY + 1, TRAIN_DBS_PER_FAMILY + EVAL_DBS_PER_FAMILY + 1)):
                db_id = f"{family}_{i}"
                rng = random.Random(f"toy-rows:{seed}:{db_id}")
                rows = make_rows(rng, fam)
                # a memoriser writes the code it saw most in training: no database stores a code
                # a training gold already used for the word (while a fresh one is left)
                avoid = {w: set(c) for w, c in seen.items()}
                # one of the two category columns stores its codes behind a prefix ('st_pending7c')
                prefixed = (rng.choice(["parent", "child"]),)
                names = encode_categories(rng, fam, rows, avoid, prefixed)
                rel = f"database/{db_id}/{db_id}.sqlite"
                write_db(out / rel, fam, rows)
                with sqlite3.connect(f"file:{out / rel}?mode=ro", uri=True) as con:
                    qs = questions(random.Random(f"toy-questions:{seed}:{db_id}"), fam, rows, names,
                                   TRAIN_PER_DB if split == "train" else EVAL_PER_DB, con)
                con.close()
                for j, (tname, question, sql, lookup, first) in enumerate(qs):
                    rec = make_record(f"toy-{db_id}-{j:03d}", "toy", db_id, rel, question, sql)
                    splits[split].append({**rec, "template": tname, "lookup_sql": lookup,
                                          "first_lookup_sql": first})
                    if split == "train" and lookup:
                        word, suffix = CODE.fullmatch(re.findall(r"'([^']*)'", sql)[0]).groups()
                        seen[word][suffix] += 1
    for split in ("eval", "train"):  # train.jsonl last: the trainer takes it as "the set is there"
        check_golds(out, splits[split])
        write_jsonl(out / f"{split}.jsonl", splits[split])
    (out / "toy_version").write_text(f"{TOY_VERSION}\n")
    stats = {s: len(r) for s, r in splits.items()}
    stats["templates"] = {s: Counter(r["template"] for r in recs) for s, recs in splits.items()}
    stats["tool"] = {s: sum(bool(r["lookup_sql"]) for r in recs) for s, recs in splits.items()}
    stats["refine"] = {s: sum(bool(r["first_lookup_sql"]) for r in recs) for s, recs in splits.items()}
    stats["memoriser"] = memoriser_right(splits)
    if verbose:
        print(f"toy set (seed {seed}) -> {out}: {len(FAMILIES) * (TRAIN_DBS_PER_FAMILY + EVAL_DBS_PER_FAMILY)} databases, "
              f"train {stats['train']} ({stats['tool']['train']} need the tool, {stats['refine']['train']} "
              f"a second lookup), eval {stats['eval']} ({stats['tool']['eval']} need the tool, "
              f"{stats['refine']['eval']} a second lookup)")
        print(f"  a memoriser (never looks, writes the word's most-seen training code) is right on "
              f"{stats['memoriser']['train']} of the train tool questions, {stats['memoriser']['eval']} held-out")
        print(f"  {'template':20s} {'train':>6s} {'eval':>6s}")
        for t in TEMPLATES:
            print(f"  {t:20s} {stats['templates']['train'][t]:6d} {stats['templates']['eval'][t]:6d}"
                  + ("  (tool)" if t in TOOL_TEMPLATES else ""))
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    prepare_toy(args.out, args.seed, verbose=True)
    print(f"done in {time.time() - t0:.2f}s")


if __name__ == "__main__":
    main()
