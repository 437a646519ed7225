"""sweep.py: grid expansion, variant presets against config.py, the table and plot from synthetic
metrics.jsonl files (hand-computed means and spreads), and one real sweep of 2 grid points end to
end (tiny model, 1 GRPO step each, 2 jobs), resumed without rerunning; those runs also check
that the sampler's and the trainer's logprobs agree to 1e-5 (fp32, CPU). ~30 s on 2 cores.

    .venv/bin/pytest tests/test_sweep.py -q
"""
import json
from pathlib import Path

import pytest
import yaml

import config as C
import sweep
from conftest import build_tiny_assets

# a GRPO step of ~1 s on the smallest model (as tests/test_configs.py's SMALL), no SFT
SMALL = ["model.dtype=float32", "wandb.mode=disabled", "train.steps=1", "train.eval_every=0",
         "train.save_every=0", "train.sample_every=0", "train.plot_every=0", "sft.steps=0",
         "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.dynamic_sampling=false",
         "sampling.max_new_tokens=12", "sampling.max_context=2048", "sampling.kv_budget_tokens=100000",
         "data.max_eval_examples=4", "data.max_train_examples=8", "env.workers=1",
         "optim.micro_batch_tokens=4096"]


# -----------------------------------------------------------------------------
# grid and presets


def test_grid_expands_to_the_cartesian_product_per_variant():
    grid = sweep.parse_grid(["grpo.loss=grpo,gspo,cispo", "--optim.lr=1e-3,2e-3"])
    assert grid == {"grpo.loss": ["grpo", "gspo", "cispo"], "optim.lr": ["1e-3", "2e-3"]}
    pts = sweep.expand([], grid)
    assert [n for n, _ in pts][:2] == ["grpo.loss=grpo,optim.lr=1e-3", "grpo.loss=grpo,optim.lr=2e-3"]
    assert len(pts) == 6 and len({n for n, _ in pts}) == 6
    assert pts[5][1] == {"grpo.loss": "cispo", "optim.lr": "2e-3"}
    both = sweep.expand(["dapo", "gspo"], {"optim.lr": ["1", "2"]})
    assert [n for n, _ in both] == ["dapo,optim.lr=1", "dapo,optim.lr=2", "gspo,optim.lr=1", "gspo,optim.lr=2"]
    assert both[0][1]["grpo.clip_high"] == 0.28 and both[0][1]["optim.lr"] == "1"  # the grid wins over the variant
    assert sweep.expand([], {}) == [("base", {})]
    with pytest.raises(C.ConfigError, match="unknown variant"):
        sweep.expand(["dapoo"], {})
    with pytest.raises(C.ConfigError, match="v1,v2"):
        sweep.parse_grid(["grpo.loss"])


def test_bad_grid_key_fails_before_anything_runs(tmp_path):
    with pytest.raises(C.ConfigError, match="unknown config key 'grpo.los'"):
        sweep.main(["configs/tiny.yaml", "--grid", "grpo.los=grpo", "--out", str(tmp_path)])
    with pytest.raises(C.ConfigError, match="grpo.loss"):
        sweep.main(["configs/tiny.yaml", "--grid", "grpo.loss=grpo,ppo", "--out", str(tmp_path)])
    with pytest.raises(C.ConfigError, match="point 'grpo.group_size=1'.*grpo.group_size"):  # a value out of range
        sweep.main(["configs/tiny.yaml", "--grid", "grpo.group_size=4,1", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # nothing written, nothing run


def test_presets_mean_the_papers_settings():
    """Each variant, applied on the embedded default, gives the recipe's config (not just the keys)."""
    def cfg(name):
        return C.load_config(["configs/tiny.yaml", *sweep.argv_of(sweep.VARIANTS[name])]).grpo
    sky = cfg("skyrl-grpo")
    assert (sky.loss, sky.clip_low, sky.clip_high, sky.loss_agg, sky.kl_beta, sky.advantage) == \
        ("grpo", 0.2, 0.2, "token-mean", 0.0, "group")
    assert not sky.dynamic_sampling and sky.rollout_is == "none"  # tiny.yaml has dynamic sampling on
    dapo = cfg("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.dynamic_sampling, dapo.loss_agg) == (0.2, 0.28, True, "token-mean")
    dr = cfg("drgrpo")
    assert (dr.advantage, dr.loss_agg) == ("none", "drgrpo")
    g = cfg("gspo")
    assert (g.loss, g.loss_agg) == ("gspo", "seq-mean-token-mean")
    # clip < 0 = the loss's own default: GSPO's 3e-4/4e-4, CISPO's (1.0 = no lower bound, 0.28)
    from trainer.losses import LOSSES
    assert LOSSES["gspo"].clip == (3e-4, 4e-4) and (g.clip_low, g.clip_high) == (-1.0, -1.0)
    c = cfg("cispo")
    assert c.loss == "cispo" and LOSSES["cispo"].clip == (1.0, 0.28)
    tis = cfg("skyrl-grpo+tis")
    assert (tis.rollout_is, tis.rollout_is_cap, tis.loss) == ("token-tis", 2.0, "grpo")
    for name in sweep.VARIANTS:  # every variant sets the same keys: a variant means the same on any base
        assert set(sweep.VARIANTS[name]) >= set(sweep.VARIANTS["skyrl-grpo"]), name


# -----------------------------------------------------------------------------
# table and plot from synthetic runs


def fake_run(d: Path, curve: dict[int, float], wall_s: float, done=True):
    d.mkdir(parents=True)
    lines = [{"step": 0, "sft/loss": 1.0}] + [{"step": s, "eval/ex": v, "eval/reward": v} for s, v in curve.items()]
    lines += [{"step": max(curve), "run/done": 1.0}] if done else []
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "wall.json").write_text(json.dumps({"wall_s": wall_s}))


def test_table_and_plot_from_synthetic_runs(tmp_path):
    points = [("a", {}), ("b", {}), ("c", {})]
    fake_run(tmp_path / "a/seed1", {0: 0.30, 10: 0.40, 20: 0.50}, 60)
    fake_run(tmp_path / "a/seed2", {0: 0.34, 10: 0.44, 20: 0.60}, 180)
    fake_run(tmp_path / "b/seed1", {0: 0.30, 20: 0.20}, 120)
    fake_run(tmp_path / "b/seed2", {0: 0.30, 20: 0.90}, 120, done=False)  # unfinished: not counted
    rows = sweep.summarise(points, [1, 2], tmp_path)
    assert [r["name"] for r in rows] == ["a", "b"]  # c has no runs
    md = sweep.table(rows)
    # a: start (30, 34) -> 32 ± 2.83; end (50, 60) -> 55 ± 7.07; Δ (20, 26) -> 23 ± 4.24; wall 2 min
    assert "| a | 2 | 32.0 ± 2.8 | 55.0 ± 7.1 | 23.0 ± 4.2 | 20 | 2.0 |" in md
    assert "| b | 1 | 30.0 ± 0.0 | 20.0 ± 0.0 | -10.0 ± 0.0 | 20 | 2.0 |" in md
    sweep.report(points, [1, 2], tmp_path, "python sweep.py x")
    assert (tmp_path / "results.md").read_text().startswith("`python sweep.py x`")
    assert (tmp_path / "ex.png").stat().st_size > 5_000


# -----------------------------------------------------------------------------
# one real sweep


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_tiny_assets(tmp_path_factory.mktemp("assets"))


def test_real_sweep_of_two_points_then_resume(assets, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["configs/tiny.yaml", "--grid", "grpo.loss=grpo,cispo", "--seeds", "3", "--jobs", "2",
            "--out", str(out), *[x for s in [*assets, *SMALL] for x in ("--set", s)]]
    sweep.main(argv)
    for loss in ("grpo", "cispo"):
        d = out / f"grpo.loss={loss}" / "seed3"
        assert sweep.finished(d), (d / "train.log").read_text()[-2000:]
        saved = yaml.safe_load((d / "ckpt_000001" / "config.yaml").read_text())  # the run's resolved config
        assert saved["grpo"]["loss"] == loss and saved["train"]["seed"] == 3 and saved["train"]["threads"] == 1
        assert set(sweep.eval_curve(d)) == {0, 1}  # before GRPO and after the last step
        # rollout/trainer consistency through the real sampler and train.update: in fp32 on CPU the
        # sampler's recorded logprobs equal the trainer's on every response token
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        mism = [r for r in recs if "train/mismatch_abs_max" in r]
        assert mism and all(r["train/mismatch_abs_max"] <= 1e-5 for r in mism), mism
        assert all(r["train/mismatch_frac"] == 0.0 for r in mism)
    md = (out / "results.md").read_text()
    assert "| grpo.loss=grpo | 1 |" in md and "| grpo.loss=cispo | 1 |" in md
    assert (out / "ex.png").stat().st_size > 5_000
    walls = [(out / f"grpo.loss={x}/seed3/wall.json").read_text() for x in ("grpo", "cispo")]
    capsys.readouterr()
    sweep.main(argv)  # resumable: finished runs are not rerun
    log = capsys.readouterr().out
    assert log.count("finished, skipped") == 2 and "0 run(s) to do" in log
    assert walls == [(out / f"grpo.loss={x}/seed3/wall.json").read_text() for x in ("grpo", "cispo")]
