"""Held-out EX on the toy set, split into questions that need the tool and those answerable directly.

    .venv/bin/python bench/toy_eval.py --model runs/tiny/ckpt_000040/hf [--config configs/tiny.yaml]
                                       [--data runs/toy/eval.jsonl] [--db-root runs/toy] [--max-turns N]

Runs `eval.py generate` (greedy, the training rollout) into --out, then joins its traces.jsonl with
the records' `lookup_sql` (toy/prepare_toy.py: non-empty = the question names a category the
database stores as a code, so only a lookup shows the right literal). Prints one JSON line:
EX overall / on tool questions / on refine questions (the tool questions whose natural lookup
returns no rows: `first_lookup_sql`) / on direct questions, tool calls per episode on each kind, how
often a tool question's final query has the code's word right (the digit and letter come from the
lookup), how many copy the code's twin instead ('Paris_N' for 'Paris4k'), how many tool answers use LIKE (which
matches the word without the lookup: on toy set v3 the twin too) and how many of those are right,
and the error-recovery rate (episodes whose first query failed or returned no rows, still right).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def breakdown(traces: list[dict], records: list[dict]) -> dict:
    """traces: eval.py generate's traces.jsonl lines (one sample each); records: the data jsonl."""
    needs = {r["id"]: bool(r.get("lookup_sql")) for r in records}
    refine = {r["id"]: bool(r.get("first_lookup_sql")) for r in records}
    out = {"n": len(traces)}
    for name, keep in (("all", lambda t: True), ("tool", lambda t: needs[t["id"]]),
                       ("refine", lambda t: refine[t["id"]]), ("direct", lambda t: not needs[t["id"]])):
        ts = [t for t in traces if keep(t)]
        n = max(1, len(ts))
        out[f"ex_{name}"] = round(100 * sum(t["exec_match"] for t in ts) / n, 1)
        out[f"tool_calls_{name}"] = round(sum(t["num_tool_calls"] for t in ts) / n, 2)
    # tool questions: did the final query at least name the code's word ('Paris' of 'Paris42')?
    gold = {r["id"]: r["gold_sql"] for r in records}
    tool = [t for t in traces if needs[t["id"]]]
    word = lambda t: re.findall(r"'(?:[a-z]{2}_)?([A-Za-z]+)\d", gold[t["id"]])[0]  # noqa: E731 ('st_pending7c')
    out["tool_word_right"] = round(100 * sum(word(t) in t["prediction"] for t in tool) / max(1, len(tool)), 1)
    # the code's twin ('Paris_N' beside 'Paris4k': '_' and a capital after the word) copied instead of the code
    twin = lambda t: re.escape(re.findall(r"'([^']*)'", gold[t["id"]])[0][:-2]) + r"_[A-Z]'"  # noqa: E731
    out["tool_answers_twin"] = sum(bool(re.search(twin(t), t["prediction"] or "")) for t in tool)
    # a LIKE in the answer matches the word without reading the lookup ('%Athens%' finds 'ci_Athens9r'
    # and, from toy set v3 on, its twin 'ci_Athens_N' too): how many tool answers take that route,
    # and how many of those are right
    wildcard = [t for t in tool if " LIKE " in (t["prediction"] or "").upper()]
    out["tool_answers_like"] = len(wildcard)
    out["tool_right_like"] = sum(t["exec_match"] for t in wildcard)
    # a first query that failed or returned nothing, and the episode still ended right
    first_bad = [t for t in traces if t["first_query_bad"]]  # eval.py generate sets it per episode
    out["first_query_bad"] = len(first_bad)
    out["recovered"] = sum(t["exec_match"] for t in first_bad)
    # the same on refine questions, where an empty first lookup is the database's doing
    first_bad = [t for t in first_bad if refine[t["id"]]]
    out["refine_first_query_bad"] = len(first_bad)
    out["refine_recovered"] = sum(t["exec_match"] for t in first_bad)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint's hf/ folder")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--data", default="runs/toy/eval.jsonl")
    ap.add_argument("--db-root", default="runs/toy")
    ap.add_argument("--max-turns", type=int, default=0)
    ap.add_argument("--out", default="runs/toy_eval")
    a = ap.parse_args()
    cmd = [sys.executable, str(ROOT / "eval.py"), "generate", "--model", a.model, "--data", a.data,
           "--db-root", a.db_root, "--config", a.config, "--out", a.out, "--threads", "1",
           "--temperature", "0"] + (["--max-turns", str(a.max_turns)] if a.max_turns else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    traces = [json.loads(line) for line in open(Path(a.out) / "traces.jsonl")]
    records = [json.loads(line) for line in open(a.data)]
    print(json.dumps(breakdown(traces, records)))


if __name__ == "__main__":
    main()
