"""BIRD (dev / train json, with evidence) -> canonical jsonl (sqltask/dataset.py).

    python data/prepare_bird.py --src path/to/bird --out runs/bird [--splits dev,train] [--no-exec]

BIRD ships each split as <split>.json (fields question_id (dev), db_id, question, evidence, SQL,
difficulty) next to <split>_databases/<db_id>/<db_id>.sqlite. They are looked for in --src, in
--src/<split>/ and in any folder one level below --src (e.g. dev_20240627/). Writes <split>.jsonl
and skipped_<split>.jsonl (missing database, gold error, gold over --timeout: BIRD's own limit is
30 s and two dev golds exceed it; ~4% of train golds fail). Records' db_path is relative to --src.
Golds run in a process pool (--workers); --no-exec only checks that the databases exist.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: sqltask/dataset.py
from sqltask.dataset import make_record, run_golds, write_jsonl  # noqa: E402


def find_split(src: Path, split: str) -> tuple[Path, Path] | None:
    """(<split>.json, <split>_databases) in src, src/<split> or a child folder of src."""
    cands = [src, src / split] + sorted(p for p in src.iterdir() if p.is_dir())
    for d in cands:
        if (d / f"{split}.json").is_file() and (d / f"{split}_databases").is_dir():
            return d / f"{split}.json", d / f"{split}_databases"
    return None


def convert_split(src: Path, split: str, exec_gold=True, timeout_s=30.0, workers=0):
    found = find_split(src, split)
    if found is None:
        return None
    path, db_dir = found
    with open(path, encoding="utf-8") as fh:
        rows = json.load(fh)
    records, skipped, to_run = [], [], []
    for i, r in enumerate(rows):
        db_id = r["db_id"]
        sql = (r.get("SQL") or r.get("sql") or r.get("query") or "").strip()
        rid = f"bird-{split}-{r.get('question_id', i)}"
        db_file = db_dir / db_id / f"{db_id}.sqlite"
        base = dict(id=rid, split=split, db_id=db_id, question=r["question"], gold_sql=sql)
        if not db_file.is_file():
            skipped.append({**base, "reason": f"database missing: {db_id}"})
        elif not sql:
            skipped.append({**base, "reason": "gold missing: no SQL field"})
        else:
            rec = make_record(rid, "bird", db_id, os.path.relpath(db_file, src), r["question"], sql,
                              evidence=r.get("evidence", ""))
            records.append(rec)
            to_run.append((db_file, sql))
    if exec_gold and records:
        errs = run_golds(to_run, timeout_s, workers)
        ok = []
        for rec, err in zip(records, errs):
            if err:
                skipped.append(dict(id=rec["id"], split=split, db_id=rec["db_id"], question=rec["question"],
                                    gold_sql=rec["gold_sql"], reason=f"gold fails: {err}"))
            else:
                ok.append(rec)
        records = ok
    return records, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--splits", default="dev,train")
    ap.add_argument("--no-exec", action="store_true", help="do not run the golds (only check databases)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per gold (BIRD's limit is 30)")
    ap.add_argument("--workers", type=int, default=0, help="processes for the golds; 0 = all cores")
    a = ap.parse_args()
    src, out = Path(a.src).resolve(), Path(a.out)
    print(f"{src} -> {out}")
    done = 0
    for split in a.splits.split(","):
        res = convert_split(src, split, not a.no_exec, a.timeout, a.workers)
        if res is None:
            print(f"  {split:6s} not found ({split}.json + {split}_databases/ under {src})")
            continue
        recs, skipped = res
        write_jsonl(out / f"{split}.jsonl", recs)
        write_jsonl(out / f"skipped_{split}.jsonl", skipped)
        why = Counter(s["reason"].split(":")[0] for s in skipped)
        detail = ", ".join(f"{n} {k}" for k, n in sorted(why.items()))
        print(f"  {split:6s} {len(recs):6d} records  {len(skipped):4d} skipped" + (f" ({detail})" if detail else "")
              + f"  with evidence: {sum(bool(r['evidence']) for r in recs)}")
        done += 1
    if not done:
        sys.exit("error: no BIRD split found")
    print(f"db_root for these records: {src}")


if __name__ == "__main__":
    main()
