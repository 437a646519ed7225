"""A loop that cannot move fails at once, by name: the engine's step and the rollout's loop raise
when an iteration moves nothing, instead of spinning until CI's time runs out.

    .venv/bin/pytest tests/test_stall.py -q
"""
import pytest

from config import EnvConfig
from engine.engine import Engine, EngineStalled
from engine.sampling import StopChecker, row_key
from engine.scheduler import Batch, Scheduler, Sequence
from rollout import generate, rollout
from sqltask.tool_calls import ToolCalls
from test_engine import DATA, db, examples, scfg, tok_model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(120)  # each test here ends in seconds, or the guard is broken


def test_a_turn_that_never_ends_stops_the_engine_naming_the_row(tok_model, monkeypatch):
    """A broken turn-end rule (no budget, stop or EOS ever ends a turn): the row spends its budget,
    the device stops it, and the next window would sample nothing again and again. The engine
    raises within the turn, naming the row and its budget (6 of 6 tokens sampled: the first window
    after the budget ran out, not a later one; a guard that never fires meets the file's time limit)."""
    tok, model = tok_model
    monkeypatch.setattr(Engine, "_turn_end", lambda self, seq: False)
    prompt = tok.encode("How many pets are there?", add_special_tokens=False)
    with pytest.raises(EngineStalled, match=r"row 1 \(turn 1: 6 of its budget 6 tokens sampled"):
        generate(model, [prompt, prompt[:-1]], scfg(max_new_tokens=6), [], tok, seed=0, eos=[])


def test_rows_that_wait_while_nothing_can_be_scheduled_stop_the_engine(tok_model, monkeypatch):
    """A broken admission rule (the scheduler's prefill admits nothing: say a block count that
    never fits): the rows wait in the queue, none runs, and every later step would find the same.
    The engine raises at the first such step, saying nothing could be scheduled and how many wait,
    instead of returning no ended turn forever (the caller's `while engine.busy()` would spin)."""
    tok, model = tok_model
    monkeypatch.setattr(Scheduler, "_prefill", lambda self: Batch("prefill", []))
    prompt = tok.encode("How many pets are there?", add_special_tokens=False)
    prompts = [prompt, prompt[:-1]]  # two prompts: two queued groups
    with Engine(model, scfg(max_new_tokens=6), StopChecker(None, [], []),
                worst_case=[len(p) + 6 for p in prompts]) as engine:
        engine.add([Sequence(list(p), key=row_key(0, i), index=i) for i, p in enumerate(prompts)])
        with pytest.raises(EngineStalled, match=r"engine step 0: no forward could be scheduled; .*Rows: none "
                                                r"running; 2 waiting"):
            for _ in range(3):  # a bounded number of steps: a broken guard fails here, it does not hang
                engine.step()


def test_the_engine_with_working_rules_never_trips_the_guard(tok_model):
    """The same batch with the real rules: every row ends on its budget (length), no error."""
    tok, model = tok_model
    prompt = tok.encode("How many pets are there?", add_special_tokens=False)
    trajs = generate(model, [prompt, prompt[:-1]], scfg(max_new_tokens=6), [], tok, seed=0, eos=[])
    assert [t.turn_stop for t in trajs] == ["length", "length"]
    assert [len(t.ids) - len(t.prompt_ids) for t in trajs] == [6, 6]


def test_a_tool_result_that_never_comes_back_stops_the_rollout_naming_the_episodes(tok_model, db, monkeypatch):
    """Every turn's tool call is submitted, but its result is lost (collect returns nothing): the
    engine is idle and the loop would wait forever. The rollout raises in the episodes' first turn,
    naming them (a guard that never fires meets the file's time limit)."""
    tok, model = tok_model
    monkeypatch.setattr(ToolCalls, "collect", lambda self, step, idle: [])
    with pytest.raises(RuntimeError, match=r"rollout: an iteration .* moved nothing .* Open: episode 0 \(turn 1"):
        rollout(model, tok, examples(), EnvConfig(max_turns=3, workers=1), scfg(max_new_tokens=8), DATA, str(db),
                n=2, seed=0)
