"""SkyRL-SQL-653 (parquet) and OmniSQL-style json -> canonical jsonl (sqltask/dataset.py).

    python data/prepare_skyrl.py --src DATA.parquet|DIR --out runs/skyrl \
        --synsql-root .../SynSQL-2.5M --spider-root .../spider [--bird-root .../bird]
    python data/prepare_skyrl.py --src data.json --format json --data synsql --synsql-root ... --out ...

Parquet rows (SkyRL-SQL-653's columns): data_source, prompt (chat messages), env_class, reward_spec {method,
ground_truth = gold SQL}, db_id, data ("synsql" | "spider" | "bird": which database root),
extra_info {split, index}. The question (and BIRD-style external knowledge) is taken from the
user message of the prompt (after its last "Question:"), so our own templates can re-render it.
OmniSQL json rows: db_id, question, external_knowledge or evidence, sql | SQL | query.
In a root, <db_id>/<db_id>.sqlite is looked for under databases/, database/, train_databases/,
train/train_databases/, dev_databases/, dev/dev_databases/, test_database/ and the root itself.
db_path is relative to --db-root (default: the common folder of the roots given). Writes
<split>.jsonl (split from extra_info; json: --split) and skipped_<split>.jsonl; --exec runs golds.
Reading parquet needs pyarrow (`pip install pyarrow`); json does not.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: sqltask/dataset.py
from sqltask.dataset import make_record, run_golds, write_jsonl  # noqa: E402

DB_SUBDIRS = ["databases", "database", "train_databases", "train/train_databases", "dev_databases",
              "dev/dev_databases", "test_database", "."]
_SECTION_END = r"(?=\n\s*\n[A-Z][\w ()/-]{0,40}:|\Z)"  # a blank line then "Instructions:" etc.


def read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        sys.exit("error: reading parquet needs pyarrow: pip install pyarrow "
                 "(or convert the file to json and use --format json)")
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        sys.exit(f"error: no .parquet files in {path}")
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def _section(text: str, name: str) -> str | None:
    hits = list(re.finditer(rf"(?:^|\n)\s*{name}:[ \t]*\n?(.*?){_SECTION_END}", text, re.S))
    return hits[-1].group(1).strip() if hits else None  # the last: a worked example may come first


def question_from_prompt(prompt) -> tuple[str | None, str]:
    """(question, external knowledge) from chat messages: user messages first (the system text
    may hold an example question), the last "Question:" section of the message."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    msgs = sorted(prompt, key=lambda m: m.get("role") != "user")
    for m in msgs:
        q = _section(m.get("content") or "", "Question")
        if q:
            return q, _section(m["content"], "External Knowledge") or ""
    return None, ""


def find_db(root: Path | None, db_id: str, cache: dict) -> Path | None:
    if root is None:
        return None
    key = (root, db_id)
    if key not in cache:
        cache[key] = next((root / d / db_id / f"{db_id}.sqlite" for d in DB_SUBDIRS
                           if (root / d / db_id / f"{db_id}.sqlite").is_file()), None)
    return cache[key]


def convert(rows: list[dict], fmt: str, roots: dict, db_root: Path, default_data="synsql", split="train"):
    """-> {split: (records, skipped)}"""
    out = defaultdict(lambda: ([], []))
    cache: dict = {}
    for i, r in enumerate(rows):
        if fmt == "parquet":
            gold = (r.get("reward_spec") or {}).get("ground_truth") or ""
            info = r.get("extra_info") or {}
            sp, idx = info.get("split") or split, info.get("index", i)
            data = r.get("data") or default_data
            question, evidence = question_from_prompt(r.get("prompt") or [])
        else:
            gold = r.get("sql") or r.get("SQL") or r.get("query") or ""
            sp, idx, data = split, i, r.get("data") or default_data
            question, evidence = r.get("question"), r.get("external_knowledge") or r.get("evidence") or ""
        db_id, gold = r.get("db_id", ""), gold.strip()
        rid = f"skyrl-{sp}-{idx}" if fmt == "parquet" else f"{data}-{sp}-{idx}"
        base = dict(id=rid, split=sp, db_id=db_id, question=question, gold_sql=gold)
        recs, skipped = out[sp]
        db_file = find_db(roots.get(data), db_id, cache)
        if data not in roots:
            reason = f"unknown data field: {data!r} (expected one of synsql, spider, bird)"
        elif roots[data] is None:
            reason = f"database root not given: --{data}-root"
        elif db_file is None:
            reason = f"database missing: {db_id} under {roots[data]}"
        elif not question:
            reason = "question not found in the prompt"
        elif not gold:
            reason = "gold missing"
        else:
            source = f"skyrl-{data}" if fmt == "parquet" else data
            recs.append(make_record(rid, source, db_id, os.path.relpath(db_file, db_root), question, gold,
                                    evidence))
            continue
        skipped.append({**base, "reason": reason})
    return dict(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="a .parquet file, a folder of them, or a .json file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", choices=["auto", "parquet", "json"], default="auto")
    for d in ("synsql", "spider", "bird"):
        ap.add_argument(f"--{d}-root", default=None, help=f"database root for data={d}")
    ap.add_argument("--db-root", default=None, help="records' db_path base (default: common folder of the roots)")
    ap.add_argument("--data", default="synsql", choices=["synsql", "spider", "bird"], help="json: which root")
    ap.add_argument("--split", default="train", help="json: the split name written")
    ap.add_argument("--exec", action="store_true", help="run every gold (30 s timeout); failures are skipped")
    ap.add_argument("--workers", type=int, default=0)
    a = ap.parse_args()
    src = Path(a.src)
    fmt = a.format if a.format != "auto" else ("json" if src.suffix in (".json", ".jsonl") else "parquet")
    if fmt == "parquet":
        rows = read_parquet(src)
    else:
        with open(src, encoding="utf-8") as fh:
            rows = [json.loads(x) for x in fh if x.strip()] if src.suffix == ".jsonl" else json.load(fh)
    roots = {d: (Path(p).resolve() if p else None) for d, p in
             (("synsql", a.synsql_root), ("spider", a.spider_root), ("bird", a.bird_root))}
    given = [str(p) for p in roots.values() if p]
    if not given:
        sys.exit("error: give at least one of --synsql-root, --spider-root, --bird-root")
    db_root = Path(a.db_root).resolve() if a.db_root else Path(os.path.commonpath(given))
    print(f"{src} ({fmt}, {len(rows)} rows) -> {a.out}")
    print(f"  rows per data field: {dict(Counter(r.get('data') or a.data for r in rows))}")
    for sp, (recs, skipped) in sorted(convert(rows, fmt, roots, db_root, a.data, a.split).items()):
        if a.exec and recs:
            errs = run_golds([(db_root / r["db_path"], r["gold_sql"]) for r in recs], 30.0, a.workers)
            skipped += [{**{k: r[k] for k in ("id", "db_id", "question", "gold_sql")}, "split": sp,
                         "reason": f"gold fails: {e}"} for r, e in zip(recs, errs) if e]
            recs = [r for r, e in zip(recs, errs) if not e]
        write_jsonl(Path(a.out) / f"{sp}.jsonl", recs)
        write_jsonl(Path(a.out) / f"skipped_{sp}.jsonl", skipped)
        why = Counter(s["reason"].split(":")[0] for s in skipped)
        detail = ", ".join(f"{n} {k}" for k, n in sorted(why.items()))
        print(f"  {sp:8s} {len(recs):6d} records  {len(skipped):4d} skipped" + (f" ({detail})" if detail else "")
              + f"  by source: {dict(Counter(r['source'] for r in recs))}")
    print(f"db_root for these records: {db_root}")


if __name__ == "__main__":
    main()
