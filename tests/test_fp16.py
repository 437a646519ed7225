"""model.dtype float16: dynamic loss scaling (trainer/loss_scale.py) on the FSDP2 path, fp16
gradients against fp32 ones, the config refusals, a killed fp16 run resuming exactly, and the
overflow verdict agreeing across 2 ranks.

    .venv/bin/python -m pytest -q tests/test_fp16.py
"""
import subprocess
import sys
import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import config as C
from conftest import ROOT, run_dist_check
from test_packing import make_model, make_trajs
from trainer import config_checks, distributed, memory, optim
from trainer.loss_scale import LossScaler


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def weights(model) -> dict:
    return {n: full(p) for n, p in model.named_parameters()}


def update(model, ref_model, opt, sch, trajs, cfg, scaler) -> dict:
    """One GRPO batch through train.update, advantages +-1 alternating per trajectory."""
    import train
    adv = [torch.full((len(t.token_turns()),), 1.0 if i % 2 else -1.0) for i, t in enumerate(trajs)]
    run = train.Run(model, ref_model, None, opt, sch, scaler, None, cfg, None, 0, 1, torch.device("cpu"))
    return train.update(run, trajs, adv)


# -----------------------------------------------------------------------------
# the scaler on the real update path


@pytest.mark.parametrize("mini_batches, kl_beta", [(1, 0.0), (2, 0.1)])
def test_overflow_skips_the_step_lowers_the_scale_then_it_grows_back(one_rank, mini_batches, kl_beta):
    """A scale of 2^24 overflows fp16's backward (largest value 65504, the gradients here ~1): each
    such optimizer step leaves the fp32 masters and the lr schedule untouched and halves the scale;
    it is counted as an overflow skip, not as a non-finite step (train.max_bad_steps must not stop
    the run for it). Once the scale fits, steps go through, and after loss_scale_interval (3) clean
    steps in a row it doubles. With 2 mini-batches (and the KL term, its reference in fp16) the
    scaler updates once per optimizer step: skips + steps taken = optimizer steps."""
    cfg = C.load_config(["--optim.loss_scale_init=16777216", "--optim.loss_scale_interval=3",
                         f"--grpo.mini_batches={mini_batches}", f"--grpo.kl_beta={kl_beta}", "--optim.lr=1e-3",
                         "--sampling.temperature=1.0"])
    model = distributed.shard(make_model(), torch.float16)
    ref = distributed.shard(make_model().requires_grad_(False), torch.float16) if kl_beta else None
    opt, sch = optim.make_optimizer(model, cfg.optim, cfg.optim.lr, 0, 100)
    warnings = []
    scaler = LossScaler(cfg.optim, torch.float16, warn=warnings.append)
    trajs = make_trajs(n_groups=2, G=4)
    expected, clean_run, verdicts = 2.0 ** 24, 0, []
    for _ in range(12 // mini_batches):
        before, taken = weights(model), sch.last_epoch
        m = update(model, ref, opt, sch, trajs, cfg, scaler)
        assert m["skipped"] == 0.0  # an overflow is the scaler's business, not a bad step
        moved = any(not torch.equal(before[n], w) for n, w in weights(model).items())
        assert moved == (sch.last_epoch > taken)  # the masters move exactly when a step is taken
        if mini_batches == 1:  # the rule, step by step: halve on an overflow, double after 3 clean steps
            verdicts.append("clean" if moved else "overflow")
            clean_run = clean_run + 1 if moved else 0
            expected = expected * 2 if clean_run and clean_run % 3 == 0 else expected / 2 if not moved else expected
            assert scaler.scale_value == expected, (verdicts, scaler.scale_value)
    assert scaler.overflow_skips + sch.last_epoch == 12  # one scaler update per optimizer step
    assert scaler.overflow_skips >= 3 and sch.last_epoch >= 3 and scaler.nonfinite_skips == 0 and not warnings
    if mini_batches == 1:
        # it came down from 2^24, then grew back at least once
        assert verdicts[:3] == ["overflow"] * 3 and "clean,clean,clean" in ",".join(verdicts), verdicts


def test_a_non_finite_loss_is_reported_once_as_an_fp16_activation_overflow(one_rank):
    """A loss that is itself not finite (the forward overflowed) is no loss scale's fault: the step
    is skipped, the scale kept, the skip counted apart from overflows, and one line names it."""
    cfg = C.load_config([])
    model = distributed.shard(make_model(), torch.float16)
    opt, sch = optim.make_optimizer(model, cfg.optim, 1e-3, 0, 10)
    warnings = []
    scaler = LossScaler(cfg.optim, torch.float16, warn=warnings.append)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    before = weights(model)
    for _ in range(2):
        logp, _ = model(ids[:, :-1], ids[:, 1:])
        scaler.scale(-logp.mean() * float("inf")).backward()
        norm = optim.step_optimizer(model, opt, sch, cfg.optim, scaler)
        assert norm != norm or norm == float("inf")
    assert scaler.nonfinite_skips == 2 and scaler.overflow_skips == 0 and scaler.scale_value == 65536.0
    assert len(warnings) == 1 and "fp16 activation overflow" in warnings[0]
    assert all(torch.equal(before[n], w) for n, w in weights(model).items())


def test_inactive_outside_float16_and_state_round_trips():
    cfg = C.load_config([])
    for dtype in (torch.float32, torch.bfloat16):
        s = LossScaler(cfg.optim, dtype)
        loss = torch.tensor(2.5)
        assert s.scale(loss) is loss and s.update(False) == "" and s.metrics() == {} and s.scale_value == 1.0
    s = LossScaler(cfg.optim, torch.float16)
    s.scale_value, s.clean_steps, s.overflow_skips, s.nonfinite_skips = 1024.0, 7, 6, 1
    t = LossScaler(cfg.optim, torch.float16)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    assert all(isinstance(v, (int, float, bool)) for v in s.state_dict().values())  # weights_only loads it


# -----------------------------------------------------------------------------
# fp16 gradients against fp32 ones


def grads_of(dtype, scale: float, loss_factor: float = 1.0) -> dict:
    """Full fp32 gradients of a next-token loss of make_model() computed in `dtype` (FSDP2 mixed
    precision, fp32 masters), the loss scaled by `scale` and unscaled (LossScaler) when scale != 1."""
    model = distributed.shard(make_model(), dtype)
    o = copy.copy(C.load_config([]).optim)
    o.loss_scale_init = scale
    scaler = LossScaler(o, torch.float16 if scale != 1 else torch.float32)
    ids = torch.randint(0, 50, (4, 33), generator=torch.Generator().manual_seed(1))
    logp, _ = model(ids[:, :-1], ids[:, 1:])
    scaler.scale(-logp.mean() * loss_factor).backward()
    scaler.unscale_(model.parameters())
    return {n: full(p.grad) / loss_factor for n, p in model.named_parameters()}


def rel_err(a: dict, b: dict) -> float:
    num = sum(float((a[n] - b[n]).double().norm() ** 2) for n in a)
    return (num / sum(float(b[n].double().norm() ** 2) for n in b)) ** 0.5


def test_fp16_gradients_match_fp32_closer_than_bf16(one_rank):
    """Relative error ||g - g32|| / ||g32|| over all parameters: fp16 (scaled by 2^16, unscaled)
    within 1e-2 of fp32 and below bf16's (fp16 keeps 10 mantissa bits, bf16 7). A loss 2^-24 times
    smaller, unscaled, loses its fp16 gradients to underflow (fp16's smallest subnormal is 6e-8);
    with the loss scale it matches again."""
    g32 = grads_of(torch.float32, 1.0)
    e16, ebf = rel_err(grads_of(torch.float16, 65536.0), g32), rel_err(grads_of(torch.bfloat16, 1.0), g32)
    assert e16 < 1e-2 and e16 < ebf / 2, (e16, ebf)
    tiny = 2.0 ** -24
    assert rel_err(grads_of(torch.float16, 1.0, tiny), g32) > 0.1  # underflow without scaling
    assert rel_err(grads_of(torch.float16, 2.0 ** 30, tiny), g32) < 1e-2


# -----------------------------------------------------------------------------
# config refusals


def test_bfloat16_on_a_gpu_without_it_names_float16():
    msg = config_checks.dtype_problem("bfloat16", cuda=True, bf16_supported=False)
    assert "--model.dtype=float16" in msg and "model.dtype=bfloat16" in msg
    assert config_checks.dtype_problem("bfloat16", cuda=True, bf16_supported=True) == ""
    assert config_checks.dtype_problem("bfloat16", cuda=False, bf16_supported=False) == ""  # CPU runs it
    assert config_checks.dtype_problem("float16", cuda=True, bf16_supported=False) == ""
    config_checks.check_device_dtype(C.load_config(["--model.dtype=bfloat16"]), torch.device("cpu"))


@pytest.mark.parametrize("arg, key", [("--optim.loss_scale_init=0", "optim.loss_scale_init"),
                                      ("--optim.loss_scale_growth=1.0", "optim.loss_scale_growth"),
                                      ("--optim.loss_scale_backoff=1.0", "optim.loss_scale_backoff"),
                                      ("--optim.loss_scale_backoff=0", "optim.loss_scale_backoff"),
                                      ("--optim.loss_scale_interval=0", "optim.loss_scale_interval")])
def test_loss_scale_settings_out_of_range_are_refused(arg, key):
    with pytest.raises(C.ConfigError, match=key):
        config_checks.validate(C.load_config([arg]))


def test_float16_is_a_dtype_and_float8_is_not():
    assert distributed.compute_dtype(C.load_config(["--model.dtype=float16"])) == torch.float16
    with pytest.raises(C.ConfigError, match="float16"):
        C.load_config(["--model.dtype=float8"])


# -----------------------------------------------------------------------------
# a killed fp16 run continues exactly; 2 ranks agree on every skip


def test_fp16_kill_and_resume_is_exact(tmp_path):
    """test_train's kill -9 test in float16 with a loss scale that moved: it starts at 2^40, so the
    warm start's first steps overflow until it has come down (x 1/16 a skip: it lands well below the
    overflow, so the GRPO steps compared have gradients) to a scale fp16 holds, and it never grows
    back (interval 1000). The resumed run must restore the scale and its counters from trainer.pt:
    restarted at 2^40 its next steps would be skipped and its weights would differ."""
    from test_train import assert_resumed_steps_learn_alike, kill_after_step_2_and_resume, learning_args, read_metrics
    args = learning_args(tmp_path) + ["--model.dtype=float16", "--optim.loss_scale_init=1099511627776",
                                      "--optim.loss_scale_interval=1000", "--optim.loss_scale_backoff=0.0625",
                                      "--train.steps=4",
                                      "--train.save_every=1", "--train.keep_checkpoints=10"]
    out, _ = kill_after_step_2_and_resume(args, tmp_path, timeout=600)
    assert "fp16: loss scale" in out, out[-3000:]
    assert_resumed_steps_learn_alike(tmp_path / "straight", tmp_path / "killed", (3, 4))
    ms = {r["step"]: r for r in read_metrics(tmp_path / "straight") if "train/loss_scale" in r}
    mr = {r["step"]: r for r in read_metrics(tmp_path / "killed") if "train/loss_scale" in r}
    assert [ms[s]["train/loss_scale"] for s in (3, 4)] == [mr[s]["train/loss_scale"] for s in (3, 4)]
    assert ms[4]["train/overflow_skips"] == mr[4]["train/overflow_skips"] > 0  # the warm start overflowed


def test_two_ranks_agree_on_overflow_and_non_finite_skips():
    """tests/fp16_dist_check.py: one rank's loss overflows fp16's backward (or is NaN), the other's
    does not; the global gradient norm and the all-reduced loss flag make both ranks skip, and
    count it under the same name."""
    check = run_dist_check("fp16_dist_check.py", timeout=240)
    assert check.returncode == 0 and sorted(check.results) == [0, 1], check.why()
    for rank, lines in check.results.items():  # each rank: its verdicts on the 3 steps, its scale, its counts
        assert lines == [f"RESULT rank={rank} verdicts=overflow,nonfinite_loss,clean scale=32768 overflow=1 "
                         "nonfinite=1 moved=1"], check.why()


def test_mismatch_bench_smoke():
    """bench/mismatch.py --smoke: every dtype measured on both models, the headline lines last; in
    float32 the sampler and the training forward agree to fp32 rounding (|r| < 1e-5 per token)."""
    import os
    p = subprocess.run([sys.executable, "bench/mismatch.py", "--smoke", "--threads", "1"], cwd=ROOT,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[-1].startswith("mismatch_abs_mean_fp16_over_bf16: ") and float(lines[-1].split()[-1]) > 0, out
    assert {line.split(":")[0] for line in lines[-3:-1]} == {"mismatch_abs_mean_fp16_over_bf16_warm",
                                                            "mismatch_abs_mean_fp16_over_bf16_random"}
    for model in ("warm", "random_smoke"):
        rows = {line.split()[1]: line for line in lines if line.startswith(model + " ")}
        assert set(rows) == {"float32", "bfloat16", "float16"}, lines
        assert float(rows["float32"].split("abs_max")[1].split()[0]) < 1e-5, rows["float32"]


# -----------------------------------------------------------------------------
# configs/sql_env_t4.yaml


T4_GIB = 14.7  # what torch reports of a T4's 15,360 MiB (before the CUDA context)
QWEN3_06B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": True, "rope_theta": 1e6}  # Qwen/Qwen3-0.6B's config.json


def test_sql_env_t4_fits_a_t4_with_lora_and_not_without():
    """memory_estimate of the recipe on the Qwen3-0.6B shape: the full-model warm start (no KL
    reference yet) and GRPO on LoRA fit a T4; GRPO fully fine-tuned (fp32 masters, grads, AdamW and
    the fp16 reference) does not, which is why the recipe uses LoRA."""
    from model import ModelArgs, Transformer
    from trainer import lora
    cfg = C.load_config([str(ROOT / "configs" / "sql_env_t4.yaml")])
    assert cfg.model.dtype == "float16" and cfg.model.lora_rank > 0 and cfg.env.protocol == "actions"
    assert cfg.reward.dense and cfg.sft.steps > 0
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(QWEN3_06B))
    assert 5.9e8 < sum(p.numel() for p in model.parameters()) < 6.0e8
    warm = memory.memory_estimate(model, C.load_config([str(ROOT / "configs" / "sql_env_t4.yaml"),
                                                             "--grpo.kl_beta=0"]), world=1)
    full_grpo = memory.memory_estimate(model, cfg, world=1)
    lora.apply(model, cfg.model)
    lora_grpo = memory.memory_estimate(model, cfg, world=1)
    assert warm["total"] < T4_GIB - 0.5 and lora_grpo["total"] < T4_GIB / 2, (warm, lora_grpo)
    assert full_grpo["total"] > T4_GIB, full_grpo
    assert abs(full_grpo["ref_weights"] - 2 * 596_049_920 / 1024 ** 3) < 0.01  # the tied fp16 reference


def test_sql_env_t4_runs_a_tiny_step_in_float16(tmp_path, monkeypatch, capsys):
    """The recipe at a tiny shape on CPU in its own dtype (tests/test_configs.py runs every config in
    float32): the full-model warm start and the LoRA GRPO step with its KL term, under loss scaling."""
    import json
    import train
    from conftest import build_tiny_assets
    from test_configs import SMALL
    assets = ["--" + a for a in build_tiny_assets(tmp_path / "assets")]
    small = [a for a in SMALL if not a.startswith("--model.dtype")]
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["train.py", str(ROOT / "configs" / "sql_env_t4.yaml"), *assets, *small,
                                      "--sft.steps=2", "--sft.batch_size=2", f"--train.out_dir={out}"])
    train.main()
    log = capsys.readouterr().out
    assert "fp32 masters, float16 compute" in log and "LoRA: rank 32" in log and "fp16: loss scale" in log, log[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in recs if "train/reward" in r)
    assert step["train/loss_scale"] > 0 and "train/kl" in step and "sft/loss" in {k for r in recs for k in r}
