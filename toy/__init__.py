"""The embedded default's assets: the toy text-to-SQL set and the tiny tokenizer and model.

    prepare_toy.py   the toy set: 130 generated SQLite databases, train.jsonl, eval.jsonl (python -m toy.prepare_toy)
    schemas.py       its schema families, value pools and database builder
    tiny.py          the tiny BPE tokenizer and random model as HF folders; a toy run's assets when absent
"""
