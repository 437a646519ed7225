"""Are two runs' metrics the same? Every key of every line of two metrics.jsonl files, timing aside.

    .venv/bin/python bench/same_metrics.py runs/ref/metrics.jsonl runs/new/metrics.jsonl [--renamed OLD=NEW ...]

A change that only moves code must leave the main command's metrics.jsonl identical on every key
(equal floats, not close ones): the held-out evals, the losses, the rewards, the grad norms. Timing
and memory keys (time/*, mem/*, train/tokens_per_s) differ from run to run and are left out. Keys
one file has and the other lacks are listed (a new metric is not a difference in behaviour).
`--renamed OLD=NEW`: a metric the first file logs as OLD and the second as NEW (a rename) is
compared under its new name.
Prints one line per differing line, then the headline `identical_lines: K/N`; exit 1 when any differ.
"""
import argparse
import json
import sys

TIMING = ("time/", "mem/", "train/tokens_per_s")


def lines(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(ln) for ln in fh if ln.strip()]


def compare(a: list[dict], b: list[dict], renamed: dict | None = None) -> tuple[int, list[str], set[str]]:
    """(identical lines, one description per differing line, keys in only one of the files).
    renamed: {a's key: b's key} for metrics renamed between the two runs."""
    same, diffs, only = 0, [], set()
    renamed = renamed or {}
    for k, (x, y) in enumerate(zip(a, b)):
        xs = {renamed.get(key, key): v for key, v in x.items() if not key.startswith(TIMING)}
        ys = {key: v for key, v in y.items() if not key.startswith(TIMING)}
        only |= set(xs) ^ set(ys)
        bad = [key for key in set(xs) & set(ys) if xs[key] != ys[key]]
        if bad:
            diffs.append(f"line {k + 1} (step {x.get('step')}): " + ", ".join(
                f"{key} {xs[key]!r} vs {ys[key]!r}" for key in sorted(bad)))
        else:
            same += 1
    if len(a) != len(b):
        diffs.append(f"{len(a)} lines vs {len(b)}")
    return same, diffs, only


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref")
    ap.add_argument("new")
    ap.add_argument("--renamed", action="append", default=[], metavar="OLD=NEW",
                    help="a metric REF logs as OLD and NEW logs as NEW, compared under NEW")
    args = ap.parse_args(argv)
    renamed = dict(x.split("=", 1) for x in args.renamed)
    a, b = lines(args.ref), lines(args.new)
    same, diffs, only = compare(a, b, renamed)
    for d in diffs:
        print(d)
    if only:
        print("keys in one file only (not compared): " + ", ".join(sorted(only)))
    print(f"identical_lines: {same}/{max(len(a), len(b))}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
