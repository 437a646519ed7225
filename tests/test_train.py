"""The trainer end to end: GRPO raises reward on a trivial task (signs, masks, normalisation),
the SFT gold trajectories mask exactly the model side, a 2-process torchrun run works, and a
killed run resumes to bit-identical weights."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer import checkpoint
import config as C
from trainer import distributed, memory
from trainer import optim
import rollout
import stream
from sqltask import chat
from trainer import run_log
import sft
from toy import tiny
import train
from conftest import ROOT, Bounded, grpo_update, torchrun_env
from model import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import padded  # noqa: E402  (bench/padded.py: the padded reference layout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny(Transformer, str(d), None, vocab_size=300, hidden_size=32, layers=1, heads=2, kv_heads=1, seed=0)
    from transformers import AutoTokenizer
    return str(d), AutoTokenizer.from_pretrained(str(d))


def test_grpo_update_raises_reward_on_trivial_task(tiny_model):
    """Reward = fraction of sampled tokens equal to one target token. A handful of GRPO updates
    through train.update (the real loss, masks and normaliser) must raise it clearly."""
    path, tok = tiny_model
    torch.manual_seed(0)
    model = Transformer.from_pretrained(path)
    cfg = C.load_config(["--sampling.temperature=1.0", "--sampling.top_p=1.0", "--sampling.max_new_tokens=6",
                         "--optim.lr=0.03", "--optim.grad_clip=1.0", "--optim.weight_decay=0.0",
                         "--grpo.group_size=8"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=0.0)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    target = tok.encode("a", add_special_tokens=False)[0]
    prompt = tok.encode("<|im_start|>user\nsay a<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    G, P = cfg.grpo.group_size, 4

    def sample(seed):
        trajs = rollout.generate(model, [prompt] * (P * G), cfg.sampling, [], tok, seed=seed, eos=[])
        # the prompt is never rewarded: only sampled tokens (mask 1) count
        r = [sum(int(i == target) for i, m in zip(t.ids, t.loss_mask) if m) / max(1, sum(t.loss_mask))
             for t in trajs]
        return trajs, torch.tensor(r)

    _, r0 = sample(1000)
    for step in range(25):
        trajs, r = sample(step)
        adv = train.grpo.advantages(r, G, "group")
        model.train()
        grpo_update(model, None, opt, sch, trajs, adv, cfg)
    _, r1 = sample(1000)
    assert r1.mean() > r0.mean() + 0.25, (float(r0.mean()), float(r1.mean()))


def test_sft_gold_trajectory_masks_model_side(tmp_path, tiny_model):
    path, tok = tiny_model
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(tmp_path), seed=0)
    from sqltask import dataset
    ex = dataset.load_examples(str(tmp_path / "train.jsonl"), str(tmp_path), limit=1)[0]
    for conv in ("single", "conversation"):
        cfg = C.load_config([f"--env.conversation={conv}", "--data.prompt_template=compact"])
        p = chat.render_prompt(tok, ex, cfg.data, "tags", str(tmp_path))
        ep, = sft.gold_episodes([ex], [p], tok, cfg, [dataset.abs_db_path(ex, str(tmp_path))])
        ids, mask = ep.ids, ep.loss_mask
        assert ids[:len(p)] == p and not any(mask[:len(p)])
        model_text = tok.decode([i for i, m in zip(ids, mask) if m])
        gold_sql = ex["gold_sql"]
        think = f"<think>{cfg.sft.think_text}</think>\n"
        assert model_text == f"{think}<sql>{gold_sql}</sql>{think}<solution>{gold_sql}</solution>"  # the rollout stops on </solution>
        obs = tok.decode([i for i, m in zip(ids[len(p):], mask[len(p):]) if not m])
        assert "<observation>" in obs and "turns left" in obs  # the real tool output, not trained on


@pytest.mark.parametrize("threshold, stops_at", [(0.4, 20), (0.0, None), (0.9, None)])
def test_sft_stops_when_training_ex_reaches_the_threshold(tmp_path, tiny_model, monkeypatch, threshold, stops_at):
    """sft.stop_at_train_ex: the warm start checks training EX every stop_check_every steps and
    ends at the first check at or above the threshold; 0 turns the check off; sft.steps caps it."""
    path, tok = tiny_model
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(tmp_path), seed=0)
    from sqltask import dataset
    cfg = C.load_config([f"--sft.stop_at_train_ex={threshold}", "--sft.stop_check_every=10", "--sft.steps=40",
                         "--sft.batch_size=4", "--data.prompt_template=compact", f"--data.db_root={tmp_path}",
                         "--wandb.mode=disabled", "--train.threads=1",
                         f"--train.out_dir={tmp_path}/run"])  # the warm start saves there
    train_ex = dataset.load_examples(str(tmp_path / "train.jsonl"), str(tmp_path), limit=300)
    checks, steps = [], []
    curve = {10: 0.1, 20: 0.5, 30: 0.85}  # the stubbed training EX at each check

    def fake_evaluate(sampler, tok, exs, cfg, rank, world, device, log, step, prefix="eval"):
        checks.append((step, prefix, len(exs), sampler.refreshes))
        return {f"{prefix}/ex": curve[step]}
    real_step = optim.step_optimizer
    monkeypatch.setattr(optim, "step_optimizer", lambda *a: steps.append(1) or real_step(*a))
    monkeypatch.setattr(sft, "evaluate", fake_evaluate)
    log = run_log.Log(cfg, 0)
    model = Transformer.from_pretrained(path)
    sampler = CountingSampler()
    synced = sft.run_sft(model, sampler, tok, train_ex, [], cfg, 0, 1, torch.device("cpu"), log)
    if threshold == 0.0:
        assert checks == [] and len(steps) == 40 and sampler.refreshes == 0 and not synced
    else:
        expected = [10, 20] if stops_at else [10, 20, 30]  # none at step 40: the run ends there anyway
        assert [c[0] for c in checks] == expected and {c[1:3] for c in checks} == {("sft/train", 128)}
        # one weight sync before each check (the weights moved since the last one), none otherwise
        assert [c[3] for c in checks] == list(range(1, len(expected) + 1)) == list(range(1, sampler.refreshes + 1))
        assert len(steps) == (stops_at or 40) and synced == bool(stops_at)  # stopped on a check: in sync


class CountingSampler:
    """Stands in for policy_sampler.PolicySampler where evaluate is stubbed: counts weight syncs."""

    def __init__(self):
        self.refreshes = 0

    def refresh(self, model):
        self.refreshes += 1


@pytest.mark.parametrize("curve, stops_at, check_from", [
    ({10: (0.1, 0.0), 20: (0.5, 0.1), 30: (0.6, 0.3)}, 30, 0),  # EX first, the recovery a check later
    ({10: (0.1, 0.0), 20: (0.5, None), 30: (0.6, 0.0)}, 20, 0),  # no first query failed: nothing to recover
    ({10: (0.5, 0.2), 20: (0.6, 0.2), 30: (0.7, 0.2)}, None, 0),  # never recovers enough: the cap
    ({10: (0.5, 0.5), 20: (0.5, 0.5), 30: (0.6, 0.3)}, 30, 25)])  # no check before stop_check_from
def test_sft_stop_waits_for_the_recovery_rate(tmp_path, tiny_model, monkeypatch, curve, stops_at, check_from):
    """sft.stop_at_train_recovery: the stop also needs the check's recovery rate (first query
    empty or failed, episode still right) at or above it; sft.stop_check_from: the first check."""
    path, tok = tiny_model
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(tmp_path), seed=0)
    from sqltask import dataset
    cfg = C.load_config(["--sft.stop_at_train_ex=0.4", "--sft.stop_at_train_recovery=0.25", "--sft.steps=40",
                         f"--sft.stop_check_from={check_from}",
                         "--sft.stop_check_every=10", "--sft.batch_size=4", "--data.prompt_template=compact",
                         f"--data.db_root={tmp_path}", "--wandb.mode=disabled", "--train.threads=1",
                         f"--train.out_dir={tmp_path}/run"])  # the warm start saves there
    train_ex = dataset.load_examples(str(tmp_path / "train.jsonl"), str(tmp_path), limit=300)
    checks = []

    def fake_evaluate(sampler, tok, exs, cfg, rank, world, device, log, step, prefix="eval"):
        checks.append(step)
        ex, recovery = curve[step]
        return {f"{prefix}/ex": ex, **({f"{prefix}/recovery_rate": recovery} if recovery is not None else {})}
    monkeypatch.setattr(sft, "evaluate", fake_evaluate)
    log = run_log.Log(cfg, 0)
    sft.run_sft(Transformer.from_pretrained(path), CountingSampler(), tok, train_ex, [], cfg, 0, 1,
                torch.device("cpu"), log)
    assert checks == [c for c in range(10, (stops_at or 30) + 1, 10) if c >= check_from]
    stops = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "sft/stopped_at" in line]
    assert [m["sft/stopped_at"] for m in stops] == ([stops_at] if stops_at else [])


@pytest.mark.parametrize("near, every_near, checks, stops_at", [
    (0.3, 2, [10, 20, 22, 24, 26], 26),  # step 20 reaches 0.3: every 2 steps from there
    (0.0, 2, [10, 20, 30], 30),  # stop_near_ex 0: the coarse grid only, overshooting to 0.85
    (0.9, 2, [10, 20, 30], 30)])  # never near: the coarse grid
def test_sft_checks_finer_near_the_threshold(tmp_path, tiny_model, monkeypatch, near, every_near, checks, stops_at):
    """sft.stop_near_ex / sft.stop_check_every_near: once a check's training EX reaches stop_near_ex,
    the warm start checks every stop_check_every_near steps, so it stops soon after the climb
    crosses stop_at_train_ex instead of at the next coarse check far above it."""
    path, tok = tiny_model
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(tmp_path), seed=0)
    from sqltask import dataset
    cfg = C.load_config(["--sft.stop_at_train_ex=0.5", "--sft.stop_check_every=10", "--sft.steps=40",
                         f"--sft.stop_near_ex={near}", f"--sft.stop_check_every_near={every_near}",
                         "--sft.batch_size=4", "--data.prompt_template=compact", f"--data.db_root={tmp_path}",
                         "--wandb.mode=disabled", "--train.threads=1",
                         f"--train.out_dir={tmp_path}/run"])  # the warm start saves there
    train_ex = dataset.load_examples(str(tmp_path / "train.jsonl"), str(tmp_path), limit=300)
    curve = {10: 0.1, 20: 0.3, 22: 0.35, 24: 0.45, 26: 0.55, 28: 0.7, 30: 0.85}  # a steep climb
    seen = []

    def fake_evaluate(sampler, tok, exs, cfg, rank, world, device, log, step, prefix="eval"):
        seen.append(step)
        return {f"{prefix}/ex": curve[step]}
    monkeypatch.setattr(sft, "evaluate", fake_evaluate)
    log = run_log.Log(cfg, 0)
    sft.run_sft(Transformer.from_pretrained(path), CountingSampler(), tok, train_ex, [], cfg, 0, 1,
                torch.device("cpu"), log)
    assert seen == checks
    stops = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "sft/stopped_at" in line]
    assert [m["sft/stopped_at"] for m in stops] == [stops_at]


def near_grid_cfg(tmp_path, *extra):
    """The toy set at tmp_path and a warm start of 40 steps with a coarse (10) and a fine (near 0.3)
    check grid, stopping at training EX 0.5; extra: more --key=value overrides."""
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(tmp_path), seed=0)
    from sqltask import dataset
    cfg = C.load_config(["--sft.stop_at_train_ex=0.5", "--sft.stop_check_every=10", "--sft.steps=40",
                         "--sft.stop_near_ex=0.3", "--sft.batch_size=4", "--data.prompt_template=compact",
                         f"--data.db_root={tmp_path}", "--wandb.mode=disabled", "--train.threads=1",
                         f"--train.out_dir={tmp_path}/run", *extra])
    return cfg, dataset.load_examples(str(tmp_path / "train.jsonl"), str(tmp_path), limit=300)


def stops_logged(out_dir) -> list:
    return [m["sft/stopped_at"] for m in read_metrics(out_dir) if "sft/stopped_at" in m]


def test_sft_check_grid_returns_to_the_coarse_one_when_ex_falls_back(tmp_path, tiny_model, monkeypatch):
    """The fine grid lasts while the last check is at or above sft.stop_near_ex: a check that falls
    back below it returns to stop_check_every (training EX is noisy on 128 questions), and a later
    check near it again returns to the fine grid. Each grid is the multiples of its step count."""
    path, tok = tiny_model
    cfg, train_ex = near_grid_cfg(tmp_path, "--sft.stop_check_every_near=3")
    curve = {10: 0.1, 20: 0.35, 21: 0.25, 30: 0.4, 33: 0.6}  # near at 20, below at 21, near at 30, stop at 33
    seen = []
    monkeypatch.setattr(sft, "evaluate", lambda sampler, tok, exs, cfg, rank, world, device, log, step,
                        prefix="eval": seen.append(step) or {f"{prefix}/ex": curve[step]})
    sft.run_sft(Transformer.from_pretrained(path), CountingSampler(), tok, train_ex, [], cfg, 0, 1,
                torch.device("cpu"), run_log.Log(cfg, 0))
    assert seen == [10, 20, 21, 30, 33] and stops_logged(tmp_path / "run") == [33]


@pytest.mark.parametrize("in_a_row, killed_at, checks", [
    (1, 24, [10, 20, 22, 24, 26]),
    (2, 28, [10, 20, 22, 24, 26, 28])])  # the save at 26 holds one passing check: the stop stays at 28
def test_sft_resumes_its_weights_and_its_check_grid(tmp_path, tiny_model, monkeypatch, in_a_row, killed_at, checks):
    """A warm start killed at a check (after its save 2 steps earlier, on the fine grid) and resumed
    from that save checks where the run that was never stopped checks (24, 26: a resume on the
    coarse grid would check 30 next), stops at the same step (with sft.stop_checks_in_a_row 2 too:
    the save keeps the count, a resume that lost it would stop at 30) and ends with the same
    weights (the weights, AdamW moments, schedule and data order all came back)."""
    path, tok = tiny_model
    cfg, train_ex = near_grid_cfg(tmp_path, "--sft.stop_check_every_near=2", "--sft.save_every=2",
                                  f"--sft.stop_checks_in_a_row={in_a_row}")
    curve = {10: 0.1, 20: 0.3, 22: 0.35, 24: 0.45, 26: 0.55, 28: 0.7, 30: 0.85}
    seen = []

    class Killed(Exception):
        pass

    def fake_evaluate(sampler, tok, exs, cfg, rank, world, device, log, step, prefix="eval"):
        if step == kill_at:
            raise Killed
        seen.append(step)
        return {f"{prefix}/ex": curve[step]}
    monkeypatch.setattr(sft, "evaluate", fake_evaluate)

    def warm_start(resume_from=None):
        model = Transformer.from_pretrained(path)
        sft.run_sft(model, CountingSampler(), tok, train_ex, [], cfg, 0, 1, torch.device("cpu"), run_log.Log(cfg, 0),
                    resume_from=resume_from)
        return model

    kill_at = None
    straight = warm_start().state_dict()
    assert seen == checks and stops_logged(tmp_path / "run") == [checks[-1]]
    (tmp_path / "run" / "metrics.jsonl").unlink()
    seen.clear()
    kill_at = killed_at
    with pytest.raises(Killed):
        warm_start()
    save = checkpoint.warm_start_save(str(tmp_path / "run"))
    assert torch.load(f"{save}/trainer.pt", weights_only=True)["step"] == killed_at - 2
    kill_at = None
    resumed = warm_start(resume_from=save).state_dict()
    assert seen == checks and stops_logged(tmp_path / "run") == [checks[-1]]
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name


@pytest.mark.parametrize("in_a_row, stops_at", [(1, 10), (2, 40), (3, None)])
def test_sft_stop_needs_checks_in_a_row(tmp_path, tiny_model, monkeypatch, in_a_row, stops_at):
    """sft.stop_checks_in_a_row: a lucky check on a plateau (10: 0.5, then 0.3) does not stop the
    warm start at 2; two passing checks in a row do (30, 40); 3 never come before the cap."""
    path, tok = tiny_model
    cfg, train_ex = near_grid_cfg(tmp_path, "--sft.stop_near_ex=0", "--sft.steps=50",
                                  f"--sft.stop_checks_in_a_row={in_a_row}")
    curve = {10: 0.5, 20: 0.3, 30: 0.6, 40: 0.55}
    seen = []
    monkeypatch.setattr(sft, "evaluate", lambda sampler, tok, exs, cfg, rank, world, device, log, step,
                        prefix="eval": seen.append(step) or {f"{prefix}/ex": curve[step]})
    sft.run_sft(Transformer.from_pretrained(path), CountingSampler(), tok, train_ex, [], cfg, 0, 1,
                torch.device("cpu"), run_log.Log(cfg, 0))
    assert seen == [c for c in curve if c <= (stops_at or 40)]
    assert stops_logged(tmp_path / "run") == ([stops_at] if stops_at else [])


def test_stop_check_questions_from_unseen_databases():
    """sft.stop_check_unseen: the stop check's 128 questions are those of whole training databases
    (spread over the set), and the warm start trains on none of those databases; without it, 128
    questions spread over the set and the warm start trains on everything; no check, no questions."""
    exs = [{"id": f"{db}-{q}", "db_id": f"db{db:03d}"} for db in range(120) for q in range(17)]
    on = C.load_config(["--sft.stop_at_train_ex=0.4", "--sft.stop_check_unseen=true"]).sft
    probe, train_set = sft.stop_check_questions(exs, on)
    probe_dbs = {e["db_id"] for e in probe}
    assert len(probe) == 128 and 7 <= len(probe_dbs) <= 9
    assert not probe_dbs & {e["db_id"] for e in train_set}
    assert len(train_set) == len(exs) - 17 * len(probe_dbs)  # every question of those databases left out
    assert sorted(probe_dbs)[0] == "db000" and sorted(probe_dbs)[-1] >= "db100"  # spread over the set
    off = C.load_config(["--sft.stop_at_train_ex=0.4"]).sft
    probe, train_set = sft.stop_check_questions(exs, off)
    assert len(probe) == 128 and len({e["db_id"] for e in probe}) > 100 and train_set == exs
    assert sft.stop_check_questions(exs, C.load_config([]).sft) == ([], exs)
    with pytest.raises(ValueError, match="stop_check_unseen"):
        sft.stop_check_questions(exs[:17 * 5], on)


def test_stop_check_unseen_on_a_small_training_set_uses_trained_questions(tmp_path, tiny_model, monkeypatch):
    """A quick run (data.max_train_examples=40: 3 databases) with tiny.yaml's stop_check_unseen
    cannot leave ~8 databases out: the warm start says so in one line and checks trained questions
    (it raised a ValueError on every rank before)."""
    path, tok = tiny_model
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(tmp_path), seed=0)
    from sqltask import dataset
    cfg = C.load_config(["--sft.stop_at_train_ex=0.4", "--sft.stop_check_unseen=true", "--sft.steps=10",
                         "--sft.stop_check_every=5", "--sft.stop_check_questions=8", "--sft.batch_size=4",
                         "--data.prompt_template=compact", f"--data.db_root={tmp_path}", "--wandb.mode=disabled",
                         "--train.threads=1", f"--train.out_dir={tmp_path}/run"])
    train_ex = dataset.load_examples(str(tmp_path / "train.jsonl"), str(tmp_path), limit=40)
    assert len({ex["db_id"] for ex in train_ex}) < sft.UNSEEN_MIN_DATABASES
    probes = []
    monkeypatch.setattr(sft, "evaluate", lambda sampler, tok, exs, *a, prefix="eval", **k:
                        probes.append([ex["id"] for ex in exs]) or {f"{prefix}/ex": 0.0})
    log = run_log.Log(cfg, 0)
    printed = []
    monkeypatch.setattr(log, "print", printed.append)
    sft.run_sft(Transformer.from_pretrained(path), CountingSampler(), tok, train_ex, [], cfg, 0, 1,
                torch.device("cpu"), log)
    assert any("sft.stop_check_unseen needs >= 10 training databases" in line for line in printed)
    assert probes and set(probes[0]) <= {ex["id"] for ex in train_ex} and len(probes[0]) == 8


def test_sft_loss_runs_in_training_mode(tmp_path, tiny_model, monkeypatch):
    """The warm start's loss forwards run in training mode (dropout on), and the model comes back
    in the mode it had (from_pretrained: eval, what rollouts and scoring use)."""
    path, tok = tiny_model
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(tmp_path), seed=0)
    from sqltask import dataset
    cfg = C.load_config(["--sft.steps=2", "--sft.batch_size=4", "--data.prompt_template=compact",
                         f"--data.db_root={tmp_path}", "--wandb.mode=disabled", "--train.threads=1",
                         f"--train.out_dir={tmp_path}/run"])  # the warm start saves there
    train_ex = dataset.load_examples(str(tmp_path / "train.jsonl"), str(tmp_path), limit=16)
    modes, real_loss = [], sft.sft_loss_sum
    monkeypatch.setattr(sft, "sft_loss_sum", lambda model, *a, **kw: modes.append(model.training) or
                        real_loss(model, *a, **kw))
    log = run_log.Log(cfg, 0)
    model = Transformer.from_pretrained(path)
    sft.run_sft(model, CountingSampler(), tok, train_ex, [], cfg, 0, 1, torch.device("cpu"), log)
    assert modes and all(modes) and not model.training


def run_train(args, out_dir, nproc=1, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"} if nproc == 1 else torchrun_env()
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    # Bounded: a communicate() that times out kills the run and its ranks instead of leaving them running
    return Bounded(cmd + args + [f"--train.out_dir={out_dir}"], cwd=ROOT, env=env,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def small_args(tmp_path):
    """The tiny config, shrunk so a run takes seconds."""
    return ["configs/tiny.yaml", f"--model.path={tmp_path}/model", "--model.tiny_hidden_size=32",
            "--model.tiny_layers=1", "--model.tiny_heads=2", "--model.tiny_kv_heads=1",
            "--model.tiny_intermediate_size=64", "--model.tiny_vocab_size=400",
            f"--data.train_path={tmp_path}/toy/train.jsonl", f"--data.eval_path={tmp_path}/toy/eval.jsonl",
            f"--data.db_root={tmp_path}/toy", "--data.max_train_examples=64", "--data.max_eval_examples=8",
            "--grpo.prompts_per_step=4", "--grpo.group_size=2", "--sampling.max_new_tokens=24",
            "--grpo.dynamic_sampling=false",  # a random model's groups are all equal: keep them
            "--sft.steps=2", "--sft.batch_size=4", "--sft.eval_every=0", "--train.eval_every=2",
            "--train.sample_every=0", "--train.threads=1"]


def learning_args(tmp_path):
    """small_args with a warm start long enough that some episodes are well formed: rewards vary
    within groups, so every GRPO step has a gradient and the weights move (with the 2-step warm
    start every reward is -1 and grad_norm 0, and a resume that lost the optimizer state or the
    LR schedule would still give identical bytes). 120 steps: at 60, on the tokenizer that also
    learns the gold turns, every step-3 reward was -1."""
    return small_args(tmp_path) + ["--sft.steps=120", "--sft.lr=1e-2", "--sft.stop_at_train_ex=0",
                                   "--sampling.max_new_tokens=48", "--grpo.group_size=4"]


def assert_resumed_steps_learn_alike(straight, resumed, steps):
    """Per-step training metrics equal between the two runs, and the steps had gradients."""
    ms = {r["step"]: r for r in read_metrics(straight) if "train/reward" in r}
    mr = {r["step"]: r for r in read_metrics(resumed) if "train/reward" in r}
    for s in steps:
        assert ms[s]["train/grad_norm"] > 0, ms[s]  # the weights moved: the comparison means something
        for key in ("train/reward", "train/pg_loss", "train/grad_norm", "train/lr"):
            assert ms[s][key] == mr[s][key], (s, key, ms[s][key], mr[s][key])


def read_metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def test_two_process_torchrun_run(tmp_path):
    p = run_train(small_args(tmp_path) + ["--train.steps=2"], tmp_path / "run", nproc=2)
    out, _ = p.communicate(timeout=400)
    assert p.returncode == 0, out[-3000:]
    m = read_metrics(tmp_path / "run")
    ex = [r for r in m if "eval/ex" in r]
    assert [r["step"] for r in ex] == [0, 2]  # before GRPO (after the warm start) and after
    assert any("sft/loss" in r for r in m) and any("train/reward" in r for r in m)
    hf = tmp_path / "run" / "ckpt_000002" / "hf"
    assert (hf.parent / "vocab_digest").read_text().strip()  # what a resume checks the tokenizer against
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(hf))  # the checkpoint is a plain HF folder
    ours = Transformer.from_pretrained(str(hf))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(ref(ids).logits, ours(ids), atol=1e-4)
    # saved on 2 ranks, resumed on 1 (rank 0 reads the full state dicts, any world size loads them)
    p = run_train(small_args(tmp_path) + ["--train.steps=3"], tmp_path / "run", nproc=1)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and "resumed from" in out and "at step 2" in out, out[-3000:]
    assert (tmp_path / "run" / "ckpt_000003").exists()


@pytest.mark.timeout(1200)  # three runs, each bounded at 300-400 s itself
def test_bf16_end_to_end_with_fp32_masters_resumes_on_two_ranks(tmp_path):
    """model.dtype bfloat16 on one process: SFT, rollout, update, checkpoint all run on the FSDP2
    path with fp32 masters (the checkpoint holds fp32 weights), and the run resumes on 2 ranks
    (with the other FSDP2 unit layout)."""
    args = small_args(tmp_path) + ["--model.dtype=bfloat16", "--model.activation_checkpointing=true"]
    p = run_train(args + ["--train.steps=2"], tmp_path / "run")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and "fp32 masters, bfloat16 compute" in out, out[-3000:]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "run" / "ckpt_000002" / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    m = read_metrics(tmp_path / "run")
    assert all(r["train/grad_norm"] == r["train/grad_norm"] for r in m if "train/grad_norm" in r)  # finite
    # resumed on 2 ranks with per-block FSDP2 units (tiny.yaml: one unit): either layout shards
    # every parameter on dim 0, so model.fsdp_unit may change on resume
    p = run_train(args + ["--train.steps=3", "--model.fsdp_unit=block"], tmp_path / "run", nproc=2)
    out, _ = p.communicate(timeout=400)
    assert p.returncode == 0 and "resumed from" in out and "at step 2" in out, out[-3000:]
    assert (tmp_path / "run" / "ckpt_000003").exists()
    # a changed recipe is refused, naming the key; only --train.resume=force continues
    p = run_train(args + ["--train.steps=4", "--optim.lr=0.5"], tmp_path / "run")
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0 and "optim.lr" in out and "--train.resume=force" in out, out[-3000:]


def test_a_checkpoint_of_another_vocabulary_is_not_resumed(tmp_path, tiny_model):
    """An out_dir keeps an old run's checkpoints while the tiny model at model.path is built again
    on a new tokenizer corpus (tiny.CORPUS_VERSION) under an unchanged config: the config check
    passes, so the vocabulary is checked on its own. Resuming would put the old weights' rows
    under other tokens."""
    from trainer import checkpoint
    from transformers import AutoTokenizer
    path, tok = tiny_model
    other_dir = tmp_path / "other_tok"
    tiny.build_tiny_tokenizer(other_dir, ["SELECT name FROM singer WHERE age > 30"] * 20, vocab_size=300)
    other = AutoTokenizer.from_pretrained(str(other_dir))
    assert checkpoint.vocab_digest(tok) == checkpoint.vocab_digest(AutoTokenizer.from_pretrained(path))
    assert checkpoint.vocab_digest(other) != checkpoint.vocab_digest(tok)
    cfg = C.load_config([f"--model.path={path}", f"--train.out_dir={tmp_path}"])
    ck = tmp_path / "ckpt_000004"
    ck.mkdir()
    (ck / "config.yaml").write_text(C.dump(cfg))
    (ck / "vocab_digest").write_text(checkpoint.vocab_digest(tok) + "\n")  # as checkpoint.save writes it
    checkpoint.check_resumable(str(ck), cfg, tok)  # the same vocabulary: resumes
    with pytest.raises(C.ConfigError, match="another tokenizer"):
        checkpoint.check_resumable(str(ck), cfg, other)
    cfg.train.resume = "force"
    checkpoint.check_resumable(str(ck), cfg, other)  # forced: the user's call
    cfg.train.resume = "true"
    (ck / "vocab_digest").unlink()  # a checkpoint saved before the digest existed: not refused
    checkpoint.check_resumable(str(ck), cfg, other)


def kill_after_step_2_and_resume(args, tmp_path, timeout=300) -> tuple[str, str]:
    """A 4-step run straight (<tmp>/straight) and the same run killed with SIGKILL once its step-2
    checkpoint exists, then resumed by the same command (<tmp>/killed): both must end, the resumed
    one saying so, with identical step-4 weights. Returns (straight's output, the resumed output)."""
    p = run_train(args, tmp_path / "straight")
    out_straight, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out_straight[-3000:]
    p = run_train(args, tmp_path / "killed")
    deadline = time.time() + timeout
    while not (tmp_path / "killed" / "ckpt_000002").exists():
        assert p.poll() is None and time.time() < deadline, "run ended before its step-2 checkpoint"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "killed" / "ckpt_000004").exists(), "killed too late to test anything"
    p = run_train(args, tmp_path / "killed")
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0 and "resumed from" in out, out[-3000:]
    a = (tmp_path / "straight" / "ckpt_000004" / "hf" / "model.safetensors").read_bytes()
    b = (tmp_path / "killed" / "ckpt_000004" / "hf" / "model.safetensors").read_bytes()
    assert a == b
    return out_straight, out


def test_kill_and_resume_is_exact(tmp_path):
    """4 steps straight vs killed after the step-2 checkpoint and resumed: identical weights, on
    a run that learns (grad_norm > 0 at the steps after the resume, under LR warmup)."""
    args = learning_args(tmp_path) + ["--train.steps=4", "--train.save_every=1", "--train.keep_checkpoints=10",
                                      "--optim.warmup_steps=3"]
    kill_after_step_2_and_resume(args, tmp_path)
    # the rollouts and updates after resume were the same too: identical per-step training metrics
    assert_resumed_steps_learn_alike(tmp_path / "straight", tmp_path / "killed", (3, 4))


def test_kill_and_resume_with_episodes_in_flight_is_exact(tmp_path):
    """stream.sampling_steps_ahead 1: the step-2 checkpoint holds episodes in flight (sampled tokens
    of the next steps' chunks, tool calls pending); killed and resumed, the run loses none and trains
    none twice. With stream.recompute_kv the straight run recomputes the KV of its episodes in flight
    at every step, as a resume does, so the two are the same run: identical weights and metrics."""
    args = learning_args(tmp_path) + ["--train.steps=4", "--train.save_every=1", "--train.keep_checkpoints=10",
                                      "--stream.sampling_steps_ahead=1", "--stream.recompute_kv=true"]
    kill_after_step_2_and_resume(args, tmp_path)
    assert_resumed_steps_learn_alike(tmp_path / "straight", tmp_path / "killed", (3, 4))
    extra = torch.load(tmp_path / "killed" / "ckpt_000002" / "trainer.pt", weights_only=True)["extra"]
    in_flight = [e for c in extra["stream"][0]["chunks"] for e in c["episodes"] if e["seq"]["status"] != "new"]
    assert any(len(e["seq"]["ids"]) > e["prompt_len"] for e in in_flight)  # sampled ahead, saved, resumed


# -----------------------------------------------------------------------------
# train.main's loop with a scripted sampler: what the keep mask passes to the update, and when the
# weights are synced to the sampler


def weights(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


class ScriptedSampler:
    """Stands in for trainer/policy_sampler.PolicySampler in train.main. Its rollout (the stream's
    round, patched: the next chunk of the prompt order, rolled out by the sampler, then rewarded)
    returns G one-token episodes per example, each tagged (round, example id, sample) (a round = one rollout call within a step);
    `reward_of(round, i, j)` scores sample j of the round's i-th example (written in the episode's
    text for the patched reward). Each refresh records the policy's weights, and each rollout
    whether it samples the current ones."""

    def __init__(self, model, cfg, dtype=None):
        self.model, self.synced, self.rounds, self.current, self.asked = model, [], 0, [], []
        self.engine, self.refreshed, self.warm_up_s = self, True, 0.0
        ScriptedSampler.made.append(self)

    def refresh(self, model):
        self.synced.append(weights(model))

    def rollout(self, examples, n):
        self.asked.append([ex["id"] for ex in examples])
        now = weights(self.model)
        self.current.append(all(torch.equal(now[k], v) for k, v in self.synced[-1].items()))
        trajs = []
        for i, ex in enumerate(examples):
            for j in range(n):
                t = rollout.Trajectory.of([1, 2], [1, 2, 3], [0, 0, 1], [0.0, 0.0, -1.0], num_turns=1, index=i,
                                          sample=j)
                t.tag, t.text = (self.rounds, ex["id"], j), str(float(self.reward_of(self.rounds, i, j)))
                trajs.append(t)
        self.rounds += 1
        return trajs


def run_scripted_loop(monkeypatch, tmp_path, assets, reward_of, grad_norms, *args, step_optimizer=None):
    """train.main with the scripted sampler; the update records the episodes and advantages it is
    given (train.update, per mini-batch); optim.step_optimizer returns the next of
    `grad_norms` and, when finite, moves every weight (a skipped step moves none), or is
    `step_optimizer` when given. assets: conftest's loop_assets. Returns (the sampler, [(tags,
    advantages) per update])."""
    from reward import Reward
    from trainer import policy_update
    ScriptedSampler.made, ScriptedSampler.reward_of = [], staticmethod(reward_of)
    updates, norms = [], iter(grad_norms)

    def next_norm(model, opt, sch, cfg, scaler=None):
        g = next(norms)
        if math.isfinite(g):
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(0.01)
        return g

    def next_round(self, step, phase=None, first_group=0):  # the next chunk, rolled out by the scripted sampler
        prompts = self.order.take(self.chunk_prompts)[self.rank::self.world]
        examples = [self.examples[i] for i in prompts]
        self.consumed += 1
        with phase("rollout"):
            trajs = self.sampler.rollout(examples, self.group_size)
        with phase("reward"):
            return rollout.reward_episodes(trajs, examples, self.tokenizer, self.cfg, n=self.group_size,
                                           first_group=first_group)
    monkeypatch.setattr(train, "PolicySampler", ScriptedSampler)
    monkeypatch.setattr(stream.RolloutStream, "next_round", next_round)
    monkeypatch.setattr(rollout, "episode_rewards", lambda scripts, *a: [
        Reward(float(t.response), float(t.response) > 0, True) for t in scripts])
    monkeypatch.setattr(sft, "evaluate", lambda *a, **k: {"eval/ex": 0.0})
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: {"eval/ex": 0.0})
    monkeypatch.setattr(train, "report_random_floor", lambda *a, **k: None)
    given = {}  # the advantages train.update was handed; each mini-batch records its share of them
    monkeypatch.setattr(policy_update, "batch_tokens", lambda model, ref, trajs, advantages, cfg, device, step:
                        given.update(advantages=advantages))
    monkeypatch.setattr(policy_update, "micro_batches", lambda model, trajs, idx, cfg, device: iter(updates.append(
        ([trajs[i].tag for i in idx], [float(given["advantages"][i][0]) for i in idx])) or ()))
    monkeypatch.setattr(optim, "step_optimizer", step_optimizer or next_norm)
    monkeypatch.setattr(sys, "argv", ["train.py", "configs/tiny.yaml", *assets, "--sft.steps=0", "--train.threads=0",
                                      "--train.eval_every=0", "--train.sample_every=0", "--data.max_train_examples=16",
                                      "--data.max_eval_examples=2", "--env.workers=1", "--grpo.group_size=2",
                                      "--grpo.prompts_per_step=4", "--train.max_bad_steps=10",
                                      f"--train.out_dir={tmp_path}/run", *args])
    train.main()
    return ScriptedSampler.made[0], updates


def test_dynamic_sampling_updates_exactly_the_mixed_groups_whole_and_in_order(tmp_path, monkeypatch, loop_assets):
    """grpo.dynamic_sampling: the loop keeps the groups whose rewards differ, whole (both samples),
    in the order sampled, across a resample round, and cuts to prompts_per_step groups; each kept
    episode's advantage has the sign of its reward against its group's mean."""
    mixed = {0: {0, 2}, 1: {1, 2, 3}}  # round -> the examples whose two samples get different rewards
    sampler, updates = run_scripted_loop(
        monkeypatch, tmp_path, loop_assets, lambda rnd, i, j: int(j == 0) if i in mixed[rnd] else 0, [1.0],
        "--grpo.dynamic_sampling=true", "--grpo.max_resample_rounds=2", "--train.steps=1")
    assert sampler.rounds == 2  # round 0 kept 2 groups of 4, round 1 three more: no third round
    (tags, adv), = updates
    asked = sampler.asked  # the examples of each round, in order
    kept = [(0, asked[0][0]), (0, asked[0][2]), (1, asked[1][1]), (1, asked[1][2])]  # the 4th mixed one: cut
    assert tags == [(rnd, ex_id, j) for rnd, ex_id in kept for j in (0, 1)]
    assert [a > 0 for a in adv] == [True, False] * 4 and abs(sum(adv)) < 1e-5


def test_weights_are_synced_after_a_batch_whose_steps_moved_them(tmp_path, monkeypatch, loop_assets):
    """grpo.mini_batches 2: two optimizer steps per batch. A batch whose first step was skipped as
    non-finite and second moved the weights (or the other way round) is synced before the next
    rollout; a batch whose steps were all skipped is not (the sampler already holds those weights).
    Every rollout samples the policy's current weights."""
    sampler, updates = run_scripted_loop(
        monkeypatch, tmp_path, loop_assets, lambda rnd, i, j: j,
        [math.nan, 1.0, 1.0, math.nan, math.nan, math.nan, 1.0, 1.0],  # two optimizer steps per batch
        "--grpo.dynamic_sampling=false", "--grpo.mini_batches=2", "--train.steps=4")
    assert len(updates) == 8 and sampler.rounds == 4
    assert sampler.current == [True] * 4  # each step's rollout sampled the weights of the step before
    assert len(sampler.synced) == 1 + 3  # before the first rollout, then after steps 1, 2 and 4 (not 3)
    assert not torch.equal(sampler.synced[1]["embed_tokens.weight"], sampler.synced[0]["embed_tokens.weight"])


def test_memory_estimate_of_the_7b_recipe_fits_80gb():
    from model import ModelArgs
    hf = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
          "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1e6,
          "tie_word_embeddings": False}  # Qwen2.5-Coder-7B-Instruct's shape
    with torch.device("meta"):
        m = Transformer(ModelArgs.from_hf(hf))
    assert 7.5e9 < sum(p.numel() for p in m.parameters()) < 7.7e9
    cfg = C.load_config([str(ROOT / "configs" / "skyrl_sql_7b.yaml")])
    est = memory.memory_estimate(m, cfg, world=8)
    parts = est["params"] + est["adam"] + est["rollout_weights"] + est["kv_cache"]
    assert abs(est["resident"] - parts) < 1e-9
    assert abs(est["update"] - (parts + est["grads"] + est["gathered_unit"] + est["unit_grads"]
                                + est["activations"])) < 1e-9
    assert est["total"] == max(est["rollout"], est["update"])
    # block units: the root (untied embeddings + lm_head, 2 x 152064 x 3584) and one block gathered
    assert abs(est["gathered_unit"] * 1024 ** 3 / 2 - (2 * 152064 * 3584 + 3584 + 233_057_792)) < 1e6
    assert 40 < est["total"] < 80, est
    assert abs(est["adam"] - 8 * 7.6156e9 / 8 / 1024 ** 3) < 0.05  # two fp32 moments, sharded over 8


def test_lr_schedule_and_micro_batch_packing():
    f = optim.lr_lambda(warmup=4, total=20, schedule="cosine", min_ratio=0.1)
    assert [round(f(s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert abs(f(20) - 0.1) < 1e-9 and 0.1 < f(12) < 1.0
    assert optim.lr_lambda(0, 10)(7) == 1.0
    lengths = [5, 17, 3, 9, 9, 30, 1]
    mbs = padded.pack(lengths, budget=32)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:  # padded size within budget unless a single sequence is longer
        assert len(mb) == 1 or max(lengths[i] for i in mb) * len(mb) <= 32


def test_memory_estimate_counts_the_one_rank_fsdp2_layout():
    """1 rank, bf16 compute: fp32 masters + fp32 grads + 2 fp32 moments, and a bf16 gathered copy."""
    from model import ModelArgs
    with torch.device("meta"):
        m = Transformer(ModelArgs(model_type="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    n, gb = sum(p.numel() for p in m.parameters()), 1024 ** 3
    for dtype, unsharded_bytes in (("bfloat16", 2), ("float32", 4)):
        est = memory.memory_estimate(m, C.load_config([f"--model.dtype={dtype}"]), world=1)
        assert abs(est["params"] - 4 * n / gb) < 1e-12 and abs(est["adam"] - 8 * n / gb) < 1e-12
        assert abs(est["rollout_weights"] - unsharded_bytes * n / gb) < 1e-12


def test_load_splits_reports_both_files_at_once_and_skips_failing_golds(tmp_path, tiny_model):
    """Data problems of both splits (a malformed line, a 0-byte database) in one error before the
    warm start; a gold that fails on its database is skipped and named; every gold failing is an
    error (a run whose golds all failed used to train to the end, reward never 1)."""
    from sqltask import dataset
    from toy.prepare_toy import prepare_toy
    toy = tmp_path / "toy"
    prepare_toy(str(toy), seed=0)
    _, tok = tiny_model
    train_lines = (toy / "train.jsonl").read_text().splitlines()[:20]
    eval_lines = (toy / "eval.jsonl").read_text().splitlines()[:10]

    class Printed(list):
        def print(self, *a):
            self.append(" ".join(map(str, a)))

    def load(train_lines, eval_lines):
        (tmp_path / "train.jsonl").write_text("\n".join(train_lines) + "\n")
        (tmp_path / "eval.jsonl").write_text("\n".join(eval_lines) + "\n")
        cfg = C.load_config([f"--data.train_path={tmp_path}/train.jsonl", f"--data.eval_path={tmp_path}/eval.jsonl",
                             f"--data.db_root={toy}", "--data.prompt_template=compact", "--reward.mode=set"])
        log = Printed()
        return train.load_splits(tok, cfg, log, 0, 1), log

    def with_field(line, **kw):
        return json.dumps({**json.loads(line), **kw})

    (toy / "zero.sqlite").write_bytes(b"")
    bad_train = train_lines[:2] + ["{not json"] + train_lines[2:]
    bad_eval = [with_field(eval_lines[0], db_path="zero.sqlite")] + eval_lines[1:]
    with pytest.raises(dataset.DatasetError) as e:
        load(bad_train, bad_eval)
    msg = str(e.value)
    assert f"{tmp_path}/train.jsonl:3: not valid JSON" in msg, msg
    assert f"zero.sqlite: the database is an empty file (0 bytes) (used by 1 record(s), first on {tmp_path}/eval.jsonl:1" in msg
    # one failing gold: skipped and named
    (train_ex, held_out), log = load([with_field(train_lines[0], gold_sql="SELECT nope FROM nowhere")] + train_lines[1:],
                                     eval_lines)
    assert len(train_ex) == 19 and list(held_out) == ["eval"] and len(held_out["eval"]) == 10
    assert log == [f"WARNING: train: skipped 1 of 20 examples whose gold query fails on its database: "
                   f"{tmp_path}/train.jsonl:1: no such table: nowhere"]
    with pytest.raises(dataset.DatasetError, match=r"eval: every gold query \(10\) fails on its database"):
        load(train_lines, [with_field(line, gold_sql="SELECT 1 FROM nowhere") for line in eval_lines])
    # data.unseen_eval_path: a second held-out set, its records limited by data.max_unseen_examples,
    # its failing golds skipped and named under its own name
    unseen_lines = (toy / "eval.jsonl").read_text().splitlines()[10:20]
    (tmp_path / "eval.jsonl").write_text("\n".join(eval_lines) + "\n")
    (tmp_path / "unseen.jsonl").write_text("\n".join([with_field(unseen_lines[0], gold_sql="SELECT 1 FROM nowhere")]
                                                      + unseen_lines[1:]) + "\n")
    cfg = C.load_config([f"--data.train_path={tmp_path}/train.jsonl", f"--data.eval_path={tmp_path}/eval.jsonl",
                         f"--data.unseen_eval_path={tmp_path}/unseen.jsonl", "--data.max_unseen_examples=6",
                         f"--data.db_root={toy}", "--data.prompt_template=compact", "--reward.mode=set"])
    log = Printed()
    _, held_out = train.load_splits(tok, cfg, log, 0, 1)
    assert list(held_out) == ["eval", "unseen"] and len(held_out["unseen"]) == 5
    assert log[-1].startswith("WARNING: unseen: skipped 1 of 6 examples whose gold query fails")


def test_log_rewinds_to_a_checkpoint_and_sets_an_earlier_attempt_aside(tmp_path):
    """Resume: what was logged after the checkpoint is cut (the steps run again, logged once);
    a fresh start moves an earlier attempt's lines aside (a run stopped in its warm start had them)."""
    cfg = C.load_config([f"--train.out_dir={tmp_path}"])
    log = run_log.Log(cfg, 0)
    log.metrics(1, {"train/reward": 0.5})
    (tmp_path / "samples.jsonl").write_text('{"step": 1}\n')
    sizes = log.sizes()
    assert sizes == {"metrics.jsonl": len('{"step": 1, "train/reward": 0.5}\n'), "samples.jsonl": 12}
    log.metrics(2, {"train/reward": 0.7})
    with open(tmp_path / "samples.jsonl", "a") as fh:
        fh.write('{"step": 2}\n')
    log.rewind(sizes)
    log.metrics(2, {"train/reward": 0.6})
    assert [(r["step"], r["train/reward"]) for r in read_metrics(tmp_path)] == [(1, 0.5), (2, 0.6)]
    assert (tmp_path / "samples.jsonl").read_text() == '{"step": 1}\n'
    log.rewind(None)  # a checkpoint written before log_sizes existed: left as it is
    assert len(read_metrics(tmp_path)) == 2
    log.set_aside()
    log.metrics(1, {"sft/loss": 3.0})
    assert read_metrics(tmp_path) == [{"step": 1, "sft/loss": 3.0}]
    moved = sorted(p.name for p in tmp_path.glob("*.jsonl.*"))
    assert [m.split(".jsonl.")[0] for m in moved] == ["metrics", "samples"]


def test_a_fresh_start_sets_an_earlier_runs_checkpoints_aside(tmp_path):
    """train.resume=false in an out_dir with an earlier run's ckpt_000024: the new run's ckpt_000008
    would be pruned before it and a later resume would continue the old run."""
    for step in (0, 24):
        (tmp_path / f"ckpt_{step:06d}").mkdir()
        (tmp_path / f"ckpt_{step:06d}" / "trainer.pt").write_text("old")
    moved = checkpoint.set_aside(str(tmp_path))
    assert checkpoint.latest(str(tmp_path)) is None
    assert sorted(p.name for p in Path(moved).iterdir()) == ["ckpt_000000", "ckpt_000024"]
    assert (Path(moved) / "ckpt_000024" / "trainer.pt").read_text() == "old"  # nothing lost
    assert checkpoint.set_aside(str(tmp_path)) is None  # nothing left to move
