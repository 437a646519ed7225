"""The SQL task's plumbing, used by env.py, reward.py, rollout.py, sft.py and eval.py (it imports
nothing from the top-level files).

    sandbox.py       sandboxed SQLite: hardened read-only connections in a killable worker-process pool
    exec_match.py    execution match of a prediction against the gold (set, bag, Spider's rule), gold cache
    dataset.py       the canonical jsonl record and its loader (every line, database and gold checked)
    prompts.py       schema DDL and the prompt templates (chat messages of an example)
    chat.py          the chat template around turns: prompt ids, EOS ids, the conversation format's wrappers
    gold_turns.py    what a perfect policy writes, turn by turn (the SFT warm start's episodes)
    random_turns.py  what a random policy writes (the floor under held-out EX)
    spider_score.py  Spider's execution accuracy of a predictions file, per-example verdicts (eval.py score)
    predictions.py   eval.py generate's files: one SQL per line, majority vote, pass@k, its summary
"""
