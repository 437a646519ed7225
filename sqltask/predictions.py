"""A predictions file and what eval.py generate writes with it: one SQL per line (Spider's format),
the majority vote over samples by execution result, unbiased pass@k, the generation summary.

    line = one_line(sql)                     # a prediction on one line; a failed episode writes PLACEHOLDER
    agg = aggregate(groups)                  # {"chosen", "majority", "pass@k"}
    summary, lines = summarise_generation(records, n, decoding_label(T, top_p, n))
Tests: .venv/bin/pytest tests/test_eval_generate.py
"""
from __future__ import annotations

import collections
import math
import os
import re

from sqltask import sandbox

PLACEHOLDER = "SELECT __no_solution__"  # a failed episode's line: always an error, so always wrong
# (`SELECT 1 WHERE 0` would not do: it matches a gold that returns no rows)


def one_line(sql: str) -> str:
    """SQL on one line for a Spider-format file: whitespace runs -> one space, `--` comments ->
    /* */ (on one line they would swallow the rest), newlines/tabs inside a literal -> space
    (changes that literal; rare, and the summary scores exactly the line written)."""
    out = []
    for t in sandbox.sql_tokens(sql):
        if t.isspace():
            out.append(" ")
        elif t.startswith("--"):
            out.append("/*" + t[2:].replace("*/", "* /") + " */")
        else:
            out.append(re.sub(r"[\r\n\t]", " ", t))
    return "".join(out).strip()


def decoding_label(temperature: float, top_p: float, n: int) -> str:
    """How predictions were decoded: greedy, sampling or majority vote move scores by up to 10 points."""
    if temperature == 0:
        return "greedy"
    s = f"sampling T={temperature:g}" + (f" top_p={top_p:g}" if top_p < 1 else "")
    return s if n == 1 else f"majority@{n} over {s}"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def result_key(rows, mode: str):
    """What majority voting compares: the result as a set of rows (mode set) or a bag (bag, spider;
    spider's row order and column permutations are ignored for voting). 1 == 1.0 as in the reward."""
    rows = [tuple(r) for r in rows]
    return frozenset(rows) if mode == "set" else frozenset(collections.Counter(rows).items())


def aggregate(groups: list[list[dict]], ks=None) -> dict:
    """groups[i][j] = sample j of example i: {"correct": bool, "key": its result_key, or None when
    it has no valid answer or the answer failed to run}. Majority vote by execution result: the most
    frequent key wins, ties go to the key seen first; the vote's prediction is the first sample with
    that key (sample 0 when no sample has one). Returns {"chosen": [j per example], "majority": EX
    of the chosen samples, "pass@k": {k: mean unbiased pass@k}} for k in 1, 2, 4, ... and n."""
    n = max((len(g) for g in groups), default=0)
    ks = ks or sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if 1 <= k <= n})
    chosen = []
    for g in groups:
        counts = collections.Counter(s["key"] for s in g if s["key"] is not None)
        best = max(counts.values(), default=0)
        chosen.append(next((j for j, s in enumerate(g) if s["key"] is not None and counts[s["key"]] == best), 0))
    m = max(1, len(groups))
    return {"chosen": chosen, "majority": sum(bool(g[j]["correct"]) for g, j in zip(groups, chosen)) / m,
            "pass@k": {k: sum(pass_at_k(len(g), sum(bool(s["correct"]) for s in g), k) for g in groups) / m
                       for k in ks}}


def summarise_generation(recs: list[dict], n: int, label: str) -> tuple[dict, list[str]]:
    """recs sorted by (index, sample) -> (summary, prediction lines in data order)."""
    groups = [recs[i:i + n] for i in range(0, len(recs), n)]
    assert all(g[j]["index"] == i and g[j]["sample"] == j for i, g in enumerate(groups) for j in range(n))
    agg = aggregate([[{"correct": r["exec_match"], "key": r["_key"]} for r in g] for g in groups]) if n > 1 else None
    chosen = agg["chosen"] if agg else [0] * len(groups)
    picks = [g[j] for g, j in zip(groups, chosen)]
    by_src: dict[str, list[int]] = {}
    for p in picks:
        by_src.setdefault(p["source"], []).append(p["exec_match"])
    E = max(1, len(recs))
    s = {"decoding": label, "n_examples": len(groups), "samples_per_example": n,
         "ex": sum(p["exec_match"] for p in picks) / max(1, len(picks)),
         "ex_by_source": {k: {"ex": sum(v) / len(v), "n": len(v)} for k, v in sorted(by_src.items())}}
    if agg:
        s.update({"ex_per_sample": sum(r["exec_match"] for r in recs) / E, f"majority@{n}": agg["majority"],
                  "pass@k": {str(k): v for k, v in agg["pass@k"].items()}})
    s.update({"mean_turns": sum(r["num_turns"] for r in recs) / E,
              "mean_tool_calls": sum(r["num_tool_calls"] for r in recs) / E,
              "format_error_rate": sum(not r["format_ok"] for r in recs) / E,
              "placeholder_rate": sum(p["prediction"] == PLACEHOLDER for p in picks) / max(1, len(picks)),
              # error recovery: of the episodes whose first query failed or returned nothing, the
              # share that still ended right (what reading an observation and retrying earns)
              "first_query_bad": sum(r["first_query_bad"] for r in recs),
              "recovered": sum(r["first_query_bad"] and r["exec_match"] for r in recs),
              "end_reasons": dict(collections.Counter(r["end_reason"] for r in recs).most_common())})
    s["recovery_rate"] = s["recovered"] / s["first_query_bad"] if s["first_query_bad"] else None
    for r in recs:
        r["chosen"] = r["sample"] == chosen[r["index"]]
    return s, [p["prediction"] for p in picks]


def spider_db_root(exs: list[dict]) -> str | None:
    """The folder `score --db-root` needs, when every database is <root>/<db_id>/<db_id>.sqlite."""
    roots = {os.path.dirname(os.path.dirname(ex["db_file"])) for ex in exs
             if os.path.basename(ex["db_file"]) == ex["db_id"] + ".sqlite"
             and os.path.basename(os.path.dirname(ex["db_file"])) == ex["db_id"]}
    return roots.pop() if len(roots) == 1 and all(ex["db_file"].endswith(".sqlite") for ex in exs) else None
