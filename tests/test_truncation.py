"""Truncated episodes: why each episode ended (rollout.END_REASONS, through the real rollout and
env), the per-reason fractions a step and an eval log, grpo.mask_truncated (a truncated episode
gives no gradient, its reward still sets its group's baseline) and DAPO's soft overlong
punishment (reward.overlong_*) at its breakpoints.

    .venv/bin/pytest tests/test_truncation.py -q
"""
import math

import pytest
import torch

import config as C
import eval as evaluation
import grpo
import replay
import rollout
import sweep
from config import DataConfig, EnvConfig, RewardConfig
from reward import Reward, Transcript, episode_rewards, overlong_penalty
from sqltask.chat import render_prompt
import train
from trainer import config_checks
from trainer.loss_scale import LossScaler
from model import Transformer
from test_rollout import TURN1, TURN2, Scripted, db, example, model, scfg, tiny_dir, tok  # noqa: F401 (fixtures)

# -----------------------------------------------------------------------------
# why an episode ended, through the real rollout and env (scripted turns on a tiny model)

LONG = "<think>" + " and then" * 40  # a turn with no stop tag: cut wherever the budget ends it


def play(tok, db, model, scripts, max_turns=3, max_new_tokens=64, room=4096, conversation="single"):
    """One episode whose turn k writes scripts[k] (the last repeats); room: sampling.max_context
    above the prompt's length."""
    ecfg = EnvConfig(max_turns=max_turns, workers=1, conversation=conversation)
    prompt = render_prompt(tok, example(db), DataConfig(), "tags", str(db))
    sampling = scfg(max_new_tokens=max_new_tokens, max_context=len(prompt) + room)
    return rollout.rollout(model, tok, [example(db)], ecfg, sampling, DataConfig(), str(db), greedy=True,
                           logits_hook=Scripted(scripts))[0]


def test_end_reasons_of_crafted_episodes(tok, db, model):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turn1, turn2, long = tok.encode(TURN1), tok.encode(TURN2), tok.encode(LONG)
    assert len(long) > 3 * 20 and len(turn2) < 60
    cases = {  # name: (the episode, end_reason, truncated, turns)
        # a lookup, then the answer
        "answer": (play(tok, db, model, [turn1 + [0], turn2 + [0]]), "answer", False, 2),
        # a first turn cut at max_new_tokens (an invalid turn), then the answer: it ended on the answer
        "cut, then answer": (play(tok, db, model, [long, turn2 + [0]], max_new_tokens=60), "answer", False, 2),
        # lookups until the turn budget is spent
        "turn_budget": (play(tok, db, model, [turn1 + [0]], max_turns=2), "turn_budget", False, 2),
        # every turn cut at max_new_tokens before its stop tag, the last one too
        "turn_cut": (play(tok, db, model, [long], max_turns=2, max_new_tokens=20), "turn_cut", True, 2),
        # the first turn runs into sampling.max_context
        "context (turn)": (play(tok, db, model, [long], room=10), "context", True, 1),
        # a lookup whose observation leaves no room for another turn
        "context (observation)": (play(tok, db, model, [turn1 + [0]], room=len(turn1) + 3), "context", True, 1),
        # the model closes its only message without an answer
        "eos": (play(tok, db, model, [tok.encode("<think>no tags</think>") + [eos]]), "eos", False, 1),
    }
    for name, (t, reason, truncated, turns) in cases.items():
        assert (t.end_reason, t.truncated, t.num_turns) == (reason, truncated, turns), name
        assert t.end_reason in rollout.END_REASONS, name
    t = cases["turn_cut"][0]
    assert [b - a for a, b in t.turn_spans] == [20, 20]  # each turn cut at exactly max_new_tokens
    assert t.generated_tokens == 40 < len(t.ids) - len(t.prompt_ids)  # the observation is not the model's
    assert set(rollout.TRUNCATED) == {"context", "turn_cut"}  # turn_budget is a policy failure, not a cut


def test_replay_ends_on_the_answer(db):
    t, = replay.replay([[TURN1, TURN2]], [str(db / "pets.sqlite")], EnvConfig(workers=1), budget=3)
    assert (t.end_reason, t.truncated, t.turn_stop) == ("answer", False, "stop")


def fake_episode(value: float, end_reason: str, n_tokens: int = 3, group: int = 0, penalty: float = 0.0,
                 first: int = 5) -> rollout.Episode:
    """A one-turn episode of prompt [1, 2] then n_tokens sampled tokens first, first + 1, ..."""
    ids = [1, 2] + list(range(first, first + n_tokens))
    t = rollout.Trajectory.of([1, 2], ids, [0, 0] + [1] * n_tokens, [0.0, 0.0] + [-1.0] * n_tokens, num_turns=1,
                              end_reason=end_reason, turn_spans=[(2, len(ids))])
    return rollout.Episode(t, Reward(value, value > 0, True, overlong_penalty=penalty), {}, group)


def test_summarise_gives_the_fraction_per_end_reason_and_the_penalty_mean():
    eps = [fake_episode(1.0, "answer"), fake_episode(-1.0, "turn_cut", penalty=-0.5),
           fake_episode(-1.0, "turn_cut"), fake_episode(-1.0, "context", penalty=-1.0)]
    s = evaluation.reduce_summary(evaluation.summarise(eps), torch.device("cpu"))
    assert {k: s[k] for k in s if k.startswith("end_")} == \
        {"end_answer": 0.25, "end_turn_budget": 0.0, "end_turn_cut": 0.5, "end_context": 0.25, "end_eos": 0.0}
    assert s["truncated"] == 0.75 and s["overlong_penalty"] == pytest.approx(-1.5 / 4)


# -----------------------------------------------------------------------------
# grpo.mask_truncated


class RecordGrads(torch.optim.SGD):
    """lr 0: the update's optimizer step records each parameter's gradient and moves nothing."""

    def __init__(self, params):
        self.params = list(params)
        super().__init__(self.params, lr=0.0)
        self.grads = None

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return super().step(closure)


def test_mask_truncated_drops_the_episode_from_the_loss_not_from_its_group(tiny_dir):
    """One group of 4: rewards 1, 0, -1 (truncated, turn_cut), 0. Its reward enters the group's
    mean and std: mean 0, std sqrt(2/3) (n - 1), so the advantages are +1.2247, 0, (dropped), 0
    (without it the group would be 1, 0, 0: mean 1/3). The update's gradient is then by hand
    -Σ_{i kept} A_i Σ_t ∇ log π(y_t) / N with N the kept episodes' tokens only (token-mean, one
    optimizer step: every ratio is 1)."""
    cfg = C.load_config(["--sampling.temperature=1.0", "--optim.grad_clip=1e9", "--grpo.group_size=4",
                         "--grpo.mask_truncated=true"])
    eps = [fake_episode(1.0, "answer", 3, first=5), fake_episode(0.0, "answer", 4, first=9),
           fake_episode(-1.0, "turn_cut", 6, first=13), fake_episode(0.0, "turn_budget", 2, first=20)]
    adv = grpo.token_advantages(eps, cfg.grpo)
    trajs, kept_adv = grpo.loss_episodes(eps, adv, cfg.grpo)
    assert trajs == [eps[0].trajectory, eps[1].trajectory, eps[3].trajectory]
    a = 1 / math.sqrt(2 / 3)
    assert [x.tolist() for x in kept_adv] == [pytest.approx([a] * 3, rel=1e-5), [0.0] * 4, [0.0] * 2]
    # off: every kept episode trains, the advantages unchanged
    off, off_adv = grpo.loss_episodes(eps, adv, C.load_config(["--grpo.group_size=4"]).grpo)
    assert off == [e.trajectory for e in eps] and off_adv[2].tolist() == pytest.approx([-a] * 6, rel=1e-5)

    model = Transformer.from_pretrained(str(tiny_dir))
    opt = RecordGrads(model.parameters())
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    run = train.Run(model, None, None, opt, sch, LossScaler(cfg.optim, torch.float32), None, cfg, None, 0, 1,
                    torch.device("cpu"))
    train.update(run, trajs, kept_adv)
    model.zero_grad(set_to_none=True)
    by_hand = 0.0
    for e, A in zip([eps[0], eps[1], eps[3]], [a, 0.0, 0.0]):
        ids = torch.tensor([e.trajectory.ids])
        lp, _ = model(ids[:, :-1], targets=ids[:, 1:], temperature=1.0)
        by_hand = by_hand - A * lp[0, 1:].sum()  # positions 2.. of ids: the sampled tokens
    (by_hand / (3 + 4 + 2)).backward()
    for (name, p), got in zip(model.named_parameters(), opt.grads):
        assert torch.allclose(got, p.grad, atol=1e-6, rtol=1e-4), name
    assert any(g.abs().sum() > 0 for g in opt.grads)


def test_mask_truncated_on_a_rank_left_with_nothing():
    """A batch whose every episode was truncated leaves nothing to train (the step then skips the
    update on every rank, train.grpo_step)."""
    g = C.load_config(["--grpo.group_size=2", "--grpo.mask_truncated=true"]).grpo
    eps = [fake_episode(-1.0, "context"), fake_episode(0.5, "turn_cut")]
    assert grpo.loss_episodes(eps, grpo.token_advantages(eps, g), g) == ([], [])


# -----------------------------------------------------------------------------
# DAPO's soft overlong punishment


def test_overlong_penalty_at_its_breakpoints():
    """DAPO (Yu et al. 2025, eq. 13): R_length(y) = 0 if |y| <= L_max - L_cache; ((L_max - L_cache)
    - |y|) / L_cache if L_max - L_cache < |y| <= L_max; -1 if |y| > L_max. L_max 20, L_cache 8:
    the buffer starts after 12 tokens; by hand 16 -> (12 - 16) / 8 = -0.5, 14 -> -0.25, 20 -> -1."""
    cfg = RewardConfig(overlong_buffer_len=8, overlong_max_len=20, overlong_penalty_factor=1.0)
    got = [overlong_penalty(L, cfg) for L in (0, 12, 13, 14, 16, 20, 21, 500)]
    assert got == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -1.0, -1.0, -1.0])
    half = RewardConfig(overlong_buffer_len=8, overlong_max_len=20, overlong_penalty_factor=0.5)
    assert [overlong_penalty(L, half) for L in (12, 16, 20, 30)] == pytest.approx([0.0, -0.25, -0.5, -0.5])
    assert overlong_penalty(10_000, RewardConfig(overlong_max_len=20)) == 0.0  # buffer 0: off


def test_overlong_penalty_enters_the_reward_and_is_kept_apart(db):
    path = str(db / "pets.sqlite")
    good = "<think>t</think><solution>SELECT count(*) FROM pet</solution>"
    eps = [Transcript(path, "SELECT count(*) FROM pet", good, "SELECT count(*) FROM pet", True, [], L) for L in (10, 16)]
    cfg = RewardConfig(overlong_buffer_len=8, overlong_max_len=20)
    out = episode_rewards(eps, cfg)
    assert [(r.value, r.overlong_penalty, r.exec_match) for r in out] == [(1.0, 0.0, True), (0.5, -0.5, True)]


def test_transcript_counts_the_models_own_tokens(tok, db, model):
    t = play(tok, db, model, [tok.encode(TURN1) + [0], tok.encode(TURN2) + [0]])
    assert rollout.transcript(t, example(db), str(db)).generated_tokens == \
        sum(b - a for a, b in t.turn_spans) == len(tok.encode(TURN1)) + len(tok.encode(TURN2))


def test_config_keys_are_checked():
    def problems(*args):
        return config_checks.problems(C.load_config(list(args)))
    assert problems("--reward.overlong_buffer_len=8", "--reward.overlong_max_len=20") == []
    assert any("reward.overlong_max_len" in p for p in problems("--reward.overlong_buffer_len=8",
                                                                "--reward.overlong_max_len=8"))
    assert any("reward.overlong_penalty_factor" in p for p in problems("--reward.overlong_penalty_factor=-1"))
    assert any("reward.overlong_buffer_len" in p for p in problems("--reward.overlong_buffer_len=-1"))


def test_sweep_grid_over_mask_truncated():
    points = sweep.expand(["skyrl-grpo"], sweep.parse_grid(["grpo.mask_truncated=false,true"]))
    assert [C.load_config(["configs/tiny.yaml", *sweep.argv_of(o)]).grpo.mask_truncated for _, o in points] == \
        [False, True]
    # the presets spell out only the loss family's keys: the base config's value stands
    assert "grpo.mask_truncated" not in sweep.VARIANTS["skyrl-grpo"]
