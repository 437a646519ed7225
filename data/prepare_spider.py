"""Spider (and its Realistic / Syn / DK variants) -> canonical jsonl (sqltask/dataset.py).

    python data/prepare_spider.py --src $SPIDER_DIR --out runs/spider        # SPIDER_DIR: Spider's release folder
    python data/prepare_spider.py --src $SPIDER_DIR --out runs/spider --variant all

--variant spider (default): dev.json + train_spider.json (or train_spider.jsonl) -> dev.jsonl,
    train.jsonl, skipped.jsonl.
--variant realistic | syn | dk | all: the robustness sets of --variants-dir (default
    SRC/../spider_variants, see its README) -> realistic.jsonl, syn.jsonl (SpiderSynQuestion),
    dk.jsonl, each with skipped_<variant>.jsonl. DK's three new_* databases live in its own
    folder; the rest are Spider's.
Every record's db_path is relative to --src (DK's new_* ones as ../spider_variants/...), so one
db_root (the Spider folder) serves training and every eval set. Questions whose database is
missing or whose gold fails or times out here are not dropped silently: they go to the skipped
file with the reason. Output files are rewritten whole (idempotent). Counts are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: sqltask/dataset.py
from sqltask.dataset import make_record, run_gold, write_jsonl  # noqa: E402

VARIANTS = ("realistic", "syn", "dk")


def read_json_or_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in fh if line.strip()]
        return json.load(fh)


def find_train(src: Path) -> Path | None:
    for name in ("train_spider.json", "train_spider.jsonl"):
        if (src / name).exists():
            return src / name
    return None


def convert(rows, *, split: str, source: str, src: Path, db_dirs: list[Path], question_key="question",
            timeout_s: float = 30.0) -> tuple[list[dict], list[dict]]:
    """Source rows -> (records, skipped). db_dirs: folders holding <db_id>/<db_id>.sqlite, first
    match wins (DK: its own folder, then Spider's). ids keep the index in the source file."""
    records, skipped = [], []
    found: dict[str, Path | None] = {}
    for i, r in enumerate(rows):
        db_id, sql = r["db_id"], r["query"].strip()
        if db_id not in found:
            found[db_id] = next((d / db_id / f"{db_id}.sqlite" for d in db_dirs
                                 if (d / db_id / f"{db_id}.sqlite").is_file()), None)
        rid = f"{source}-{split}-{i}" if source == "spider" else f"{source}-{i}"
        db_file = found[db_id]
        if db_file is None:
            reason = f"database missing: {db_id}"
        else:
            err = run_gold(db_file, sql, timeout_s)
            reason = f"gold fails: {err}" if err else ""
        if reason:
            skipped.append(dict(id=rid, split=split, db_id=db_id, question=r[question_key], gold_sql=sql,
                                reason=reason))
            continue
        rel = os.path.relpath(db_file, src)  # relative to the db_root (the Spider folder)
        records.append(make_record(rid, source, db_id, rel, r[question_key], sql))
    return records, skipped


def _report(name: str, recs, skipped):
    why = Counter(s["reason"].split(":")[0] for s in skipped)
    detail = ", ".join(f"{n} {k}" for k, n in sorted(why.items()))
    print(f"  {name:10s} {len(recs):6d} records  {len(skipped):4d} skipped" + (f" ({detail})" if detail else ""))


def prepare_spider(src, out, timeout_s: float = 30.0) -> dict:
    src, out = Path(src).resolve(), Path(out)
    db_dirs = [src / "database"]
    splits = {"dev": src / "dev.json", "train": find_train(src)}
    if not splits["dev"].exists():
        raise SystemExit(f"error: {src}/dev.json not found (is --src a Spider folder?)")
    counts, all_skipped = {}, []
    for split, path in splits.items():
        if path is None:
            print(f"  note: no train_spider.json(l) in {src}; writing dev only")
            continue
        recs, skipped = convert(read_json_or_jsonl(path), split=split, source="spider", src=src,
                                db_dirs=db_dirs, timeout_s=timeout_s)
        write_jsonl(out / f"{split}.jsonl", recs)
        all_skipped += skipped
        counts[split] = (len(recs), len(skipped))
        _report(split, recs, skipped)
    write_jsonl(out / "skipped.jsonl", all_skipped)
    return counts


def prepare_variant(variant: str, src, variants_dir, out, timeout_s: float = 30.0) -> tuple[int, int]:
    src, vdir, out = Path(src).resolve(), Path(variants_dir).resolve(), Path(out)
    db_dirs = [src / "database"]
    qkey = "question"
    if variant == "realistic":
        path = vdir / "spider_realistic" / "spider-realistic.json"
    elif variant == "syn":
        path, qkey = vdir / "spider_syn" / "dev.json", "SpiderSynQuestion"
    elif variant == "dk":
        path = vdir / "spider_dk" / "Spider-DK.json"
        db_dirs = [vdir / "spider_dk" / "database"] + db_dirs  # the new_* databases
    else:
        raise ValueError(variant)
    if not path.exists():
        raise SystemExit(f"error: {path} not found (set --variants-dir)")
    recs, skipped = convert(read_json_or_jsonl(path), split=variant, source=f"spider-{variant}", src=src,
                            db_dirs=db_dirs, question_key=qkey, timeout_s=timeout_s)
    write_jsonl(out / f"{variant}.jsonl", recs)
    write_jsonl(out / f"skipped_{variant}.jsonl", skipped)
    _report(variant, recs, skipped)
    return len(recs), len(skipped)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="the Spider folder (dev.json, database/)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="spider", choices=("spider",) + VARIANTS + ("all",))
    ap.add_argument("--variants-dir", default=None, help="default: SRC/../spider_variants")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per gold query")
    a = ap.parse_args()
    vdir = a.variants_dir or str(Path(a.src).resolve().parent / "spider_variants")
    print(f"{a.src} -> {a.out}")
    if a.variant in ("spider", "all"):
        prepare_spider(a.src, a.out, a.timeout)
    for v in VARIANTS if a.variant == "all" else [a.variant] if a.variant in VARIANTS else []:
        prepare_variant(v, a.src, vdir, a.out, a.timeout)
    print(f"db_root for these records: {Path(a.src).resolve()}")


if __name__ == "__main__":
    main()
