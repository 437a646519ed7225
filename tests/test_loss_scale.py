"""trainer/loss_scale.py's rules on the update's real path (train.update -> optim.step_optimizer),
each checked against a reference: a float32 run, torch.amp.GradScaler step by step, or counts
by hand. The rules: gradients unscaled before clipping; an overflow skip leaves the logged
grad_norm finite (the mean of the steps taken); a non-finite loss in any micro-batch is a
non-finite loss, never an overflow; only non-finite losses are `skipped` steps (train.max_bad_steps
stops a run on them, never on overflows); a resumed run does not report the activation overflow
again; the clean-step count restarts after a skip; the scale stops at 2^127.

    .venv/bin/python -m pytest -q tests/test_loss_scale.py
"""
import math

import pytest
import torch

import config as C
import grpo
import train
from test_packing import make_model, make_trajs
from test_train import read_metrics, run_scripted_loop, weights
from trainer import distributed, optim
from trainer.loss_scale import MAX_SCALE, LossScaler


def update(dtype: torch.dtype, args: list[str], scaler: LossScaler | None = None):
    """One GRPO batch (make_trajs: 2 groups of 4, advantages +-1) through train.update on a fresh
    make_model() sharded in `dtype`, with plain SGD (lr 0.1): unlike AdamW its step is the gradient
    itself, so a clip shows in the weights. Returns (the update's metrics, the weight change per
    parameter, the scaler)."""
    cfg = C.load_config(["--sampling.temperature=1.0", *args])
    model = distributed.shard(make_model(), dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    scaler = scaler or LossScaler(cfg.optim, dtype)
    trajs = make_trajs(n_groups=2, G=4)
    adv = [torch.full((len(t.token_turns()),), 1.0 if i % 2 else -1.0) for i, t in enumerate(trajs)]
    before = weights(model)
    run = train.Run(model, None, None, opt, sch, scaler, None, cfg, None, 0, 1, torch.device("cpu"))
    metrics = train.update(run, trajs, adv)
    after = weights(model)
    return metrics, {n: after[n] - before[n] for n in before}, scaler


def norm(tensors: dict) -> float:
    return math.sqrt(sum(float(t.double().norm()) ** 2 for t in tensors.values()))


# -----------------------------------------------------------------------------
# unscale, then clip


# fp16 keeps 10 mantissa bits: the forward's and backward's roundings move the gradient norm by
# ~1e-3 of itself (measured: 3e-4 here); 1e-2 is the bound tests/test_fp16.py holds the gradients to
FP16_RTOL = 1e-2


def test_float16_clips_by_the_true_norm_and_logs_the_float32_grad_norm(one_rank):
    """The loss is scaled by 2^16 before backward, so the gradients arrive 2^16 times too large.
    With grad_clip between the true norm and the scaled one, the step must not clip (the true norm
    is below it): the weights move as a float32 run's do and the logged grad_norm is the float32
    one. With grad_clip below the true norm, both runs clip to grad_clip: the same step."""
    true_norm = update(torch.float32, ["--optim.grad_clip=1e9"])[0]["grad_norm"]
    between, below = 4 * true_norm, true_norm / 4
    assert true_norm < between < true_norm * 2.0 ** 16  # the scaled norm: what a clip before unscaling reads
    for clip in (between, below):
        m32, step32, _ = update(torch.float32, [f"--optim.grad_clip={clip}"])
        m16, step16, scaler = update(torch.float16, [f"--optim.grad_clip={clip}", "--model.dtype=float16"])
        assert scaler.active and scaler.scale_value == 2.0 ** 16 and scaler.last == "clean"
        assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=FP16_RTOL), (m16["grad_norm"], m32["grad_norm"])
        assert m32["grad_norm"] == pytest.approx(true_norm, rel=1e-6)
        # SGD's step is lr x the clipped gradient: lr x the true norm unclipped, lr x grad_clip clipped
        assert norm(step32) == pytest.approx(0.1 * min(true_norm, clip), rel=1e-4)
        assert norm(step16) == pytest.approx(norm(step32), rel=FP16_RTOL), (norm(step16), norm(step32), clip)
        diff = norm({n: step16[n] - step32[n] for n in step32})
        assert diff < FP16_RTOL * norm(step32)  # the same direction too


# -----------------------------------------------------------------------------
# the three verdicts of an optimizer step


def test_an_overflow_skip_logs_the_mean_grad_norm_of_the_steps_taken(one_rank):
    """Three optimizer steps (grpo.mini_batches 3) from a scale of 2^24: the first overflows fp16's
    backward and backs off by 2^-10 to 2^14, where the next two fit. The logged grad_norm is the
    mean of those two (finite), not inf or NaN; the overflow is no `skipped` step."""
    m, _, scaler = update(torch.float16, ["--model.dtype=float16", "--grpo.mini_batches=3",
                                          "--optim.loss_scale_init=16777216", "--optim.loss_scale_backoff=0.0009765625"])
    first, *taken = m["grad_norms"]
    assert not math.isfinite(first) and all(math.isfinite(x) and x > 0 for x in taken) and len(taken) == 2
    assert scaler.overflow_skips == 1 and scaler.nonfinite_skips == 0 and scaler.scale_value == 2.0 ** 14
    assert m["grad_norm"] == sum(taken) / 2 and m["grad_norm_max"] == max(taken)
    assert m["skipped"] == 0.0


@pytest.mark.parametrize("poisoned", ["first", "last"])
def test_a_non_finite_loss_in_any_micro_batch_is_a_non_finite_loss(one_rank, monkeypatch, poisoned):
    """One optimizer step over several micro-batches (optim.micro_batch_tokens 40), one of whose
    losses is NaN (an fp16 activation overflow in its forward). Whichever micro-batch it was, the
    step is skipped as a non-finite loss: counted in nonfinite_skips and as a `skipped` step, the
    scale kept, no weight moved; never as an overflow (which would halve the scale and let
    train.max_bad_steps miss it)."""
    real, losses = grpo.policy_loss, []

    def policy_loss(inputs, norm_, g, max_len):
        loss, metrics = real(inputs, norm_, g, max_len)
        losses.append(loss)
        return loss, metrics
    monkeypatch.setattr(grpo, "policy_loss", policy_loss)
    update(torch.float32, ["--optim.micro_batch_tokens=40"])  # counts the micro-batches of the step
    n = len(losses)
    assert n >= 3, n
    target = 0 if poisoned == "first" else n - 1
    losses.clear()

    def poisoned_loss(inputs, norm_, g, max_len):
        loss, metrics = real(inputs, norm_, g, max_len)
        losses.append(loss)
        return (loss * float("nan") if len(losses) - 1 == target else loss), metrics
    monkeypatch.setattr(grpo, "policy_loss", poisoned_loss)
    m, step, scaler = update(torch.float16, ["--model.dtype=float16", "--optim.micro_batch_tokens=40"])
    assert len(losses) == n
    assert scaler.last == "nonfinite_loss" and scaler.nonfinite_skips == 1 and scaler.overflow_skips == 0
    assert scaler.scale_value == 2.0 ** 16 and m["skipped"] == 1.0
    assert all(float(d.abs().max()) == 0.0 for d in step.values())


# -----------------------------------------------------------------------------
# train.max_bad_steps and a resumed run, on train.main's loop (scripted sampler)


def scaler_step(loss: float):
    """optim.step_optimizer for the scripted loop: the step's loss was `loss` and its gradients
    not finite; the real scaler gives the verdict (overflow when the loss was finite)."""
    def step_optimizer(model, opt, sch, optim_cfg, scaler=None):
        scaler.scale(torch.tensor(loss))
        scaler.update(False)
        return float("inf")
    return step_optimizer


def train_metrics(tmp_path, name: str) -> dict:
    return {r["step"]: r for r in read_metrics(tmp_path / name / "run") if "train/reward" in r}


def test_non_finite_losses_stop_the_run_at_max_bad_steps_and_overflows_never(tmp_path, monkeypatch, loop_assets):
    """float16, every step's gradients non-finite. With a NaN loss each step is `skipped`, and the
    second in a row (train.max_bad_steps 2) stops the run. With a finite loss each is an overflow:
    not skipped, the run goes to its end, every skip counted in train/overflow_skips."""
    args = ["--model.dtype=float16", "--train.max_bad_steps=2", "--train.steps=3", "--grpo.dynamic_sampling=false"]
    with pytest.raises(RuntimeError, match="2 non-finite steps in a row: stopping"):
        run_scripted_loop(monkeypatch, tmp_path / "nan", loop_assets, lambda rnd, i, j: j, [], *args,
                          step_optimizer=scaler_step(float("nan")))
    steps = train_metrics(tmp_path, "nan")
    assert sorted(steps) == [1, 2] and all(r["train/skipped"] == 1.0 for r in steps.values())
    assert steps[2]["train/nonfinite_skips"] == 2 and steps[2]["train/overflow_skips"] == 0
    run_scripted_loop(monkeypatch, tmp_path / "overflow", loop_assets, lambda rnd, i, j: j, [], *args,
                      step_optimizer=scaler_step(1.0))
    steps = train_metrics(tmp_path, "overflow")
    assert sorted(steps) == [1, 2, 3] and all(r["train/skipped"] == 0.0 for r in steps.values())
    assert steps[3]["train/overflow_skips"] == 3 and steps[3]["train/nonfinite_skips"] == 0
    assert steps[3]["train/loss_scale"] == 2.0 ** 16 / 8  # halved at each


def test_a_resumed_run_does_not_report_the_activation_overflow_again(tmp_path, monkeypatch, capsys, loop_assets):
    """A float16 run whose step 1 had a NaN loss reports it (one line) and saves ckpt_000001; the
    same command with train.steps 2 resumes from it, meets another NaN loss, and stays quiet:
    the report is once per run, and the checkpoint remembers it was made."""
    args = ["--model.dtype=float16", "--train.max_bad_steps=10", "--grpo.dynamic_sampling=false"]
    warning = "WARNING: fp16 activation overflow"
    run_scripted_loop(monkeypatch, tmp_path, loop_assets, lambda rnd, i, j: j, [], *args, "--train.steps=1",
                      step_optimizer=scaler_step(float("nan")))
    assert capsys.readouterr().out.count(warning) == 1
    run_scripted_loop(monkeypatch, tmp_path, loop_assets, lambda rnd, i, j: j, [], *args, "--train.steps=2",
                      step_optimizer=scaler_step(float("nan")))
    out = capsys.readouterr().out
    assert "resumed from" in out, out[-2000:]
    assert [line for line in out.splitlines() if warning in line] == []
    assert train_metrics(tmp_path, "")[2]["train/nonfinite_skips"] == 2  # the count went on from the checkpoint


# -----------------------------------------------------------------------------
# the scale against torch.amp.GradScaler, step by step


def scales_side_by_side(verdicts: str, init: float, interval: int) -> list[tuple[float, float, bool, bool]]:
    """Drive LossScaler through optim.step_optimizer and torch.amp.GradScaler through its own
    step/update on the same tiny model and losses; at each 'o' of `verdicts` one gradient is made
    inf (an overflow), at each 'c' none. Returns per step (our scale, GradScaler's, whether our
    step moved the weights, whether GradScaler's did)."""
    optim_cfg = C.load_config([f"--optim.loss_scale_init={init}", f"--optim.loss_scale_interval={interval}",
                               "--optim.grad_clip=1e9"]).optim
    ours, theirs = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    theirs.load_state_dict(ours.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    sch = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda step: 1.0)
    scaler = LossScaler(optim_cfg, torch.float16)
    reference = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=2.0, backoff_factor=0.5,
                                     growth_interval=interval)
    x = torch.tensor([[0.4, -0.8, 0.2]])
    out = []
    for verdict in verdicts:
        moved = []
        for model, scale, opt in ((ours, scaler.scale, opts[0]), (theirs, reference.scale, opts[1])):
            before = model.weight.detach().clone()
            # gradients <= 0.25: scaled by 2^127 they stay below float32's largest value, 3.4e38
            scale(model(x).sum() * 0.25).backward()
            if verdict == "o":
                model.weight.grad[0, 0] = float("inf")
            if model is ours:
                optim.step_optimizer(model, opt, sch, optim_cfg, scaler)
            else:
                reference.step(opt)
                reference.update()
                opt.zero_grad(set_to_none=True)
            moved.append(not torch.equal(before, model.weight.detach()))
        out.append((scaler.scale_value, reference.get_scale(), *moved))
    return out


def test_the_clean_count_restarts_after_a_skip_as_in_gradscaler():
    """Interval 4: two clean steps, an overflow, then the scale grows only after 4 more clean steps
    (not 2): the count restarts from 0 at every skip. Scale and taken steps equal GradScaler's at
    every step of a longer pattern."""
    verdicts = "ccoccccccoccccoooccccc"
    steps = scales_side_by_side(verdicts, 1024.0, 4)
    assert [s[0] for s in steps] == [s[1] for s in steps], steps
    assert [s[2] for s in steps] == [s[3] for s in steps] == [v == "c" for v in verdicts]
    assert [s[0] for s in steps[:8]] == [1024, 1024, 512, 512, 512, 512, 1024, 1024]  # by hand


def test_the_scale_stops_at_float32s_largest_power_of_two():
    """From 2^124, growing every clean step: 2^125, 2^126, 2^127, then it stays (GradScaler keeps its
    float32 scale finite the same way); the scaled loss stays finite and the steps are taken. An
    init above the cap starts at the cap."""
    steps = scales_side_by_side("cccccc", 2.0 ** 124, 1)
    assert [s[0] for s in steps] == [s[1] for s in steps] == [2.0 ** 125, 2.0 ** 126] + [2.0 ** 127] * 4
    assert all(s[2] and s[3] for s in steps) and MAX_SCALE == 2.0 ** 127
    scaler = LossScaler(C.load_config(["--optim.loss_scale_init=1e39"]).optim, torch.float16)
    assert scaler.scale_value == 2.0 ** 127 and math.isfinite(float(scaler.scale(torch.tensor(1.0))))
