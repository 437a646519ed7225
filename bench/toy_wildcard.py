"""The toy set's wildcard shortcut: how many tool questions an answer gets right by matching the
question's word with a LIKE pattern instead of copying the code the lookup shows.

    .venv/bin/python bench/toy_wildcard.py [--toy runs/toy] [--seed 0]

A tool question names a category ("Paris") the database stores as a code ('Paris47', 'ci_Paris47').
An answer such as `city LIKE '%Paris%'` needs no lookup; toy set v3 stores a twin beside every code
('Paris_N': the same word followed by letters), so every such pattern also matches the twin's rows.
For each tool question this runs the gold with the code replaced by every pattern of
prepare_toy.wildcard_patterns (wildcards before and after the word, with or without the column's
prefix: 56 patterns) and prints, for training and held-out questions, the share that some pattern
answers right and the share the best single pattern does. Builds the set at --toy when it is absent.
Exits with status 1 when a share is above 5% (the goal: only reading the lookup answers a tool
question). Tests: tests/test_toy.py::test_no_wildcard_answers_a_tool_question.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
from toy.prepare_toy import prepare_toy, wildcard_shares  # noqa: E402

GOAL = 0.05


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toy", default="runs/toy", help="the toy set's folder (data.db_root)")
    ap.add_argument("--seed", type=int, default=0, help="data.toy_seed, if the set is built here")
    a = ap.parse_args()
    if not (Path(a.toy) / "train.jsonl").exists():
        prepare_toy(a.toy, seed=a.seed)
    shares = wildcard_shares(a.toy)
    worst = 0.0
    for split, s in shares.items():
        n = max(1, s["tool"])
        worst = max(worst, s["any"] / n)
        print(f"{split:5s}: {s['tool']} tool questions; some LIKE pattern on the word answers "
              f"{s['any']} ({100 * s['any'] / n:.1f}%), the best single pattern {s['best']} "
              f"({100 * s['best'] / n:.1f}%{', ' + repr(s['best_pattern']) if s['best'] else ''})")
    print(json.dumps(shares))
    sys.exit(0 if worst <= GOAL else 1)


if __name__ == "__main__":
    main()
