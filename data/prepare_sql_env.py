"""sql_env's question set from Spider -> canonical jsonl (sqltask/dataset.py): its 10 databases, its
70/30 question split, and a second held-out set on Spider dev databases it never uses.

    python data/prepare_sql_env.py --src $SPIDER_DIR --out runs/sql_env     # SPIDER_DIR: Spider's release folder

sql_env (a GRPO text-to-SQL walkthrough: Qwen3-0.6B, TRL) pins 10 Spider databases for schema variety:
student_assessment (a Spider train database) and nine Spider dev databases. Their 676 questions
(53 from train_spider, 623 from dev.json) are split 70/30 into 473 training and 203 held-out questions;
the held-out questions ask about the same databases as training, so they measure what was learned of
those schemas. Writes:
- train.jsonl (473), eval.jsonl (203): each database's questions shuffled with --seed, its first
  round(0.7 n) to training (the split sql_env's counts give; which question goes where is ours);
  each file then shuffled, so its first N records (data.max_eval_examples) mix the databases;
- unseen.jsonl: every dev question on the other dev databases (none of which training reads): what
  carries over to a schema the policy never saw;
- skipped.jsonl: questions whose database is missing or whose gold fails here, with the reason.
Every db_path is relative to --src (the db_root of a run). Idempotent; counts printed.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # prepare_spider beside this file
from prepare_spider import convert, find_train, read_json_or_jsonl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root
from sqltask.dataset import write_jsonl  # noqa: E402

DATABASES = ("student_assessment", "concert_singer", "world_1", "car_1", "employee_hire_evaluation",
             "pets_1", "cre_Doc_Template_Mgt", "dog_kennels", "flight_2", "poker_player")
TRAIN_TENTHS = 7  # 70% of each database's questions train


def split_by_database(records: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): per database (in DATABASES order), its records shuffled with `seed`, the first
    round(0.7 n) to train, halves up (integer arithmetic: 0.7 * 45
    is 31.499... in floats). Stratified, so every database is in both halves."""
    train, held = [], []
    for db in DATABASES:
        mine = [r for r in records if r["db_id"] == db]
        random.Random(f"{seed}:{db}").shuffle(mine)
        cut = (TRAIN_TENTHS * len(mine) + 5) // 10
        train += mine[:cut]
        held += mine[cut:]
    return train, held


def prepare_sql_env(src, out, seed: int = 0, timeout_s: float = 30.0) -> dict[str, int]:
    src, out = Path(src).resolve(), Path(out)
    if not (src / "dev.json").exists():
        raise SystemExit(f"error: {src}/dev.json not found (is --src a Spider folder?)")
    train_file = find_train(src)
    if train_file is None:
        raise SystemExit(f"error: no train_spider.json(l) in {src}: student_assessment's questions are there")
    db_dirs = [src / "database"]
    rows = [r for r in read_json_or_jsonl(train_file) if r["db_id"] in DATABASES]
    train_recs, skipped = convert(rows, split="train", source="spider", src=src, db_dirs=db_dirs, timeout_s=timeout_s)
    dev_rows = read_json_or_jsonl(src / "dev.json")
    # ids keep each question's index in dev.json, so they match prepare_spider's dev.jsonl
    dev_recs, dev_skipped = convert(dev_rows, split="dev", source="spider", src=src, db_dirs=db_dirs,
                                    timeout_s=timeout_s)
    skipped += dev_skipped
    pool = train_recs + [r for r in dev_recs if r["db_id"] in DATABASES]
    missing = sorted(set(DATABASES) - {r["db_id"] for r in pool})
    if missing:
        raise SystemExit(f"error: no usable questions on {missing} in {src} (see skipped.jsonl)")
    train, held = split_by_database(pool, seed)
    unseen = [r for r in dev_recs if r["db_id"] not in DATABASES]
    for records in (train, held, unseen):  # shuffled: any prefix (data.max_eval_examples) mixes the databases
        random.Random(seed).shuffle(records)
    counts = {"train": write_jsonl(out / "train.jsonl", train), "eval": write_jsonl(out / "eval.jsonl", held),
              "unseen": write_jsonl(out / "unseen.jsonl", unseen), "skipped": write_jsonl(out / "skipped.jsonl", skipped)}
    print(f"  train {counts['train']}, eval {counts['eval']} (sql_env's 10 databases, 70/30 per database); "
          f"unseen {counts['unseen']} ({len({r['db_id'] for r in unseen})} other dev databases); "
          f"skipped {counts['skipped']}")
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="the Spider folder (dev.json, train_spider.json(l), database/)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0, help="the split's shuffle seed")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per gold query")
    a = ap.parse_args()
    print(f"{a.src} -> {a.out}")
    prepare_sql_env(a.src, a.out, a.seed, a.timeout)
    print(f"db_root for these records: {Path(a.src).resolve()}")


if __name__ == "__main__":
    main()
