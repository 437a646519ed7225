"""Scripted episodes: turns written in advance, played through the real env and tokenized exactly
as a rollout appends them. The SFT warm start's gold episodes (sft.gold_episodes) and the
random-policy floor (eval.random_floor) are such episodes; the multi-turn loop that samples
episodes is rollout.py's.

    trajs = replay(turns, db_paths, env_cfg, budget=3, tokenizer=tok, prompt_ids=p)   # rollout.Trajectory list

Tests: .venv/bin/pytest tests/test_sft.py tests/test_random_floor.py tests/test_truncation.py
"""
from __future__ import annotations

import env
from rollout import Trajectory
from sqltask.chat import observation_ids


def replay(turns: list[list[str]], db_paths: list, env_cfg, *, budget: int, tokenizer=None,
           prompt_ids: list[list[int]] | None = None, names: list | None = None) -> list[Trajectory]:
    """Episodes whose turns are written in advance (turns[i]: episode i's texts, the last one its
    answer) played through the real env (env.step_batch, one batch per turn index) and, with a
    tokenizer, tokenized exactly as rollout appends them: each turn encoded alone (mask 1; the env
    reads its decoded text, as in a rollout), each observation observation_ids of the env's own
    output (mask 0), after prompt_ids[i]. tokenizer None: text only (ids empty; text holds every
    turn and observation). budget: the generations an episode may have (at turn k the env is told
    budget - k - 1 are left). A turn that does not end at its first stop string, or that the env
    reads other than as written (a tool call, then an answer that ends the episode), raises
    ValueError naming the episode (names[i]). The SFT warm start's gold episodes
    (sft.gold_episodes) and the random-policy floor (eval.random_floor) are such episodes."""
    names = names or list(range(len(turns)))
    stops = env.STOP_STRINGS[env_cfg.protocol]
    trajs = [Trajectory.of(list(p), list(p), [0] * len(p), [0.0] * len(p))
             for p in (prompt_ids if tokenizer else [[]] * len(turns))]
    segments = [[] for _ in turns]
    for k in range(max(map(len, turns), default=0)):
        live = [i for i, t in enumerate(turns) if k < len(t)]
        said = {}
        for i in live:  # the policy's turn: encoded alone, decoded for the env as the rollout does
            t = trajs[i]
            ids = tokenizer.encode(turns[i][k], add_special_tokens=False) if tokenizer else []
            said[i] = (ids, tokenizer.decode(ids) if tokenizer else turns[i][k])
            t.turn_spans.append((len(t.ids), len(t.ids) + len(ids)))
            t.seq.extend(ids, loss=True)
            segments[i].append(said[i][1])
            text = said[i][1]  # the rollout ends a turn at its first stop string: a scripted one must end on it
            if min((text.find(x) + len(x) for x in stops if x in text), default=-1) != len(text):
                raise ValueError(f"scripted episode of {names[i]}: turn {k + 1} ({text!r}) does not end at its "
                                 f"first stop string {stops}")
        results = env.step_batch([str(db_paths[i]) for i in live], [said[i][1] for i in live],
                                 [budget - (k + 1)] * len(live), env_cfg)
        for i, res in zip(live, results):
            t, last = trajs[i], k == len(turns[i]) - 1
            t.steps.append(env.step_record(res))
            t.num_turns += 1
            t.seq.stop_reason = "stop"  # every scripted turn ends at its stop string (checked above)
            t.num_tool_calls += res.action.kind in ("sql", "describe", "sample", "query")
            if res.action.kind == "invalid" or res.done != last or (last and res.action.kind not in ("solution", "answer")):
                raise ValueError(f"scripted episode of {names[i]}: turn {k + 1} ({said[i][1]!r}) was read as "
                                 f"{res.action.kind}, done={res.done}")
            if last:
                t.finished, t.final_sql, t.end_reason = True, res.action.arg, "answer"
                continue
            if tokenizer:
                obs = observation_ids(tokenizer, res.observation, env_cfg.conversation, said[i][0][-1])
                t.seq.extend(obs)
            segments[i].append(res.observation)
    for t, segs in zip(trajs, segments):
        t.text = tokenizer.decode(t.ids[len(t.prompt_ids):]) if tokenizer else "".join(segs)
    return trajs
