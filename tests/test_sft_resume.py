"""The warm start resumes: stopped by Ctrl-C (it saves after the step in progress), then killed
with kill -9 (it continues from its last sft.save_every save), then run to its end with the same
command, it gives the warm start of a run that was never stopped: the same stop step, the same
step-0 held-out EX, the same weights to the byte, the same metrics.jsonl. ~1.5 min on 2 cores.

    .venv/bin/pytest -q tests/test_sft_resume.py
"""
import re
import signal
import time

import torch

from trainer import checkpoint
from test_train import read_metrics, run_train, small_args


def warm_start_args(tmp_path):
    """A warm start that ends at a stop check (training EX on 32 trained questions; ~step 200 of
    300 on the toy), saved every 25 steps; no GRPO step after it (train.steps 0)."""
    return small_args(tmp_path) + [
        "--sft.steps=300", "--sft.lr=1e-2", "--sampling.max_new_tokens=48", "--sft.stop_at_train_ex=0.05",
        "--sft.stop_at_train_recovery=0", "--sft.stop_check_every=20", "--sft.stop_check_from=0",
        "--sft.stop_check_questions=32", "--sft.stop_check_unseen=false", "--sft.stop_near_ex=0",
        "--sft.save_every=25", "--train.steps=0"]


def read_until(p, pattern: str, timeout: float = 300) -> str:
    """Read the run's output until a line matches `pattern`; returns what was read."""
    out, deadline = [], time.time() + timeout
    for line in p.stdout:
        out.append(line)
        if re.search(pattern, line):
            return "".join(out)
        assert time.time() < deadline, f"timed out waiting for {pattern!r}"
    raise AssertionError(f"the run ended before {pattern!r}: " + "".join(out)[-3000:])


def saved_step(run) -> int:
    return torch.load(f"{run}/{checkpoint.WARM_START}/trainer.pt", weights_only=True)["step"]


def test_a_stopped_and_killed_warm_start_resumes_to_the_same_weights(tmp_path):
    args = warm_start_args(tmp_path)
    straight = run_train(args, tmp_path / "straight")  # beside the stopped run: one core each
    run = tmp_path / "run"
    # 1. Ctrl-C mid warm start: it ends the step in progress, saves and says so
    p = run_train(args, run)
    read_until(p, r"^sft 60/300 ")
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out[-3000:]
    m = re.search(rf"stopped \(SIGINT\) after warm-start step (\d+) of 300: saved {run}/warm_start; "
                  "the same command resumes from it", out)
    assert m and saved_step(run) == int(m[1]) >= 60, out[-3000:]
    assert "Traceback" not in out and not checkpoint.latest(str(run))  # no GRPO checkpoint yet
    first = int(m[1])
    # 2. the same command continues from there; kill -9 after its next save
    p = run_train(args, run)
    seen = read_until(p, r"^sft 1[4-9]\d/300 ")  # past the save at step 125
    assert f"warm start: resumed from {run}/warm_start at step {first}\n" in seen, seen[-3000:]
    p.kill()
    p.communicate()
    second = saved_step(run)
    assert first < second < 300 and not checkpoint.latest(str(run))
    # 3. the same command again: from the last save to the end of the warm start
    p = run_train(args, run)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and f"warm start: resumed from {run}/warm_start at step {second}\n" in out, out[-3000:]
    assert not (run / checkpoint.WARM_START).exists()  # superseded by ckpt_000000
    out_straight, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0, out_straight[-3000:]

    def stop_step(run_dir):
        return [r["sft/stopped_at"] for r in read_metrics(run_dir) if "sft/stopped_at" in r]

    def step0_ex(run_dir):
        return [r["eval/ex"] for r in read_metrics(run_dir) if "eval/ex" in r]
    assert stop_step(run) == stop_step(tmp_path / "straight") and len(stop_step(run)) <= 1
    assert step0_ex(run) == step0_ex(tmp_path / "straight") and len(step0_ex(run)) == 1
    weights = "ckpt_000000/hf/model.safetensors"
    assert (run / weights).read_bytes() == (tmp_path / "straight" / weights).read_bytes()
    # every line logged once, as in the run that was never stopped (checks, losses, the stop, the eval)
    assert read_metrics(run) == read_metrics(tmp_path / "straight")


def test_a_warm_start_that_had_ended_does_not_run_again(tmp_path, monkeypatch):
    """The warm start ends early at its stop check (step 3 of 10: the check's EX is forced to 100%)
    and saves itself as ended; the run is killed before GRPO's ckpt_000000 is written. The same command, with another sft.save_every (a key that does not
    change the run: allowed), resumes the ended warm start without training a step of it again:
    ckpt_000000 holds exactly the weights the warm start ended with."""
    import sys

    import train
    from trainer import optim, runguard
    from test_train import small_args
    import sft
    args = small_args(tmp_path) + ["--sft.steps=10", "--sft.stop_at_train_ex=0.5", "--sft.stop_at_train_recovery=0",
                                   "--sft.stop_check_every=3", "--sft.stop_check_from=0", "--sft.stop_near_ex=0",
                                   "--sft.stop_check_unseen=false", "--sft.stop_check_questions=4",
                                   "--sft.stop_checks_in_a_row=1", "--sft.save_every=4", "--train.steps=0",
                                   "--train.eval_every=0", f"--train.out_dir={tmp_path}/run", "--env.workers=1"]
    monkeypatch.setattr(runguard, "lock_out_dir", lambda out_dir: None)  # two runs in one process
    monkeypatch.setattr(sft, "evaluate", lambda *a, prefix="", **k: {f"{prefix}/ex": 1.0})  # the check passes
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: {"eval/ex": 0.0})
    monkeypatch.setattr(train, "report_random_floor", lambda *a, **k: None)
    real_save = checkpoint.save

    def killed_before_ckpt0(out_dir, step, *a, name=None, **k):
        if name is None:  # GRPO's ckpt_000000, right after the warm start saved its end
            raise SystemExit(137)
        return real_save(out_dir, step, *a, name=name, **k)
    monkeypatch.setattr(checkpoint, "save", killed_before_ckpt0)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    try:
        train.main()
        raise AssertionError("the first run should have been stopped before ckpt_000000")
    except SystemExit:
        pass
    saved = torch.load(f"{tmp_path}/run/{checkpoint.WARM_START}/trainer.pt", weights_only=True)
    assert saved["step"] == 3 and saved["extra"]["finished"]
    from safetensors.torch import load_file
    ended = load_file(f"{tmp_path}/run/{checkpoint.WARM_START}/hf/model.safetensors")

    steps = []
    real_step = optim.step_optimizer
    monkeypatch.setattr(optim, "step_optimizer", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    monkeypatch.setattr(checkpoint, "save", real_save)
    monkeypatch.setattr(sys, "argv", ["train.py", *args[:-3], "--sft.save_every=5", *args[-2:]])
    train.main()
    assert steps == []  # no warm-start step ran again (and train.steps 0: no GRPO step)
    final = load_file(f"{tmp_path}/run/ckpt_000000/hf/model.safetensors")
    assert final.keys() == ended.keys() and all(torch.equal(final[k], ended[k]) for k in final)
