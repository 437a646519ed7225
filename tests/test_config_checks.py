"""trainer/config_checks.py: every numeric key has a range, each value outside it is refused naming the key,
the keys that must agree do, the model folder is checked before anything loads, and train.py
refuses a bad config at once: one line, exit 1, nothing run.

    .venv/bin/pytest -q tests/test_config_checks.py
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

import config as C
from trainer import config_checks
from conftest import ROOT


def numeric_keys():
    """Keys whose default is a number, and int keys that default to "auto" (config.int_or_auto)."""
    import dataclasses
    auto = {f"{group.name}.{f.name}" for group in dataclasses.fields(C.Config)
            for f in dataclasses.fields(group.default_factory()) if f.metadata.get("auto")}
    return sorted(k for k, v in C.all_keys().items()
                  if (isinstance(v, (int, float)) and not isinstance(v, bool)) or k in auto)


def test_every_numeric_key_has_a_range():
    """A new int/float key must say which values it takes (else it goes unchecked)."""
    assert sorted(config_checks.RANGES) == numeric_keys()


def outside(rule: str, value):
    """A value just outside a RANGES rule (an int for an int key)."""
    if rule == "any":
        return math.nan if isinstance(value, float) else None
    if rule.startswith(">="):
        bound = float(rule[2:])
        return int(bound) - 1 if isinstance(value, int) else bound - 0.5
    if rule.startswith(">"):
        return type(value)(float(rule[1:]))
    low, high = (float(x) for x in rule[1:-1].split(","))
    return high if rule[-1] == ")" else (low if rule[0] == "(" else high + 0.5)


@pytest.mark.parametrize("key", numeric_keys())
def test_each_value_outside_its_range_is_refused_naming_the_key(key):
    rule, _ = config_checks.RANGES[key]
    default = C.all_keys()[key]
    bad = outside(rule, 1 if default == "auto" else default)  # an int_or_auto key: an int outside its range
    assert bad is not None, f"{key}: an int key with rule 'any' takes every value: give it a range"
    group, name = key.split(".")
    cfg = C.Config()
    setattr(getattr(cfg, group), name, bad)
    with pytest.raises(C.ConfigError, match=rf"\b{key} must be"):
        config_checks.validate(cfg)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_and_the_defaults_pass(path):
    for world in (1, 2, 8, 16):
        config_checks.validate(C.load_config([str(path)]), world)
    config_checks.validate(C.Config())


def test_an_int_or_auto_key_takes_auto_or_an_int_and_nothing_else():
    assert C.load_config([]).sampling.kv_budget_tokens == "auto"
    assert C.load_config(["--sampling.kv_budget_tokens=65536"]).sampling.kv_budget_tokens == 65536
    for bad in ("Auto", "1e5", "true", "[1"):
        with pytest.raises(C.ConfigError, match="sampling.kv_budget_tokens' wants an int or auto"):
            C.load_config([f"--sampling.kv_budget_tokens={bad}"])


def test_silently_wrong_values_are_all_named_at_once():
    """group_size 1 (advantage 0 for every sample: nothing learned), temperature -1 (the sampler goes
    greedy while the trainer divides logits by -1), max_turns 0 (one turn ran anyway)."""
    cfg = C.load_config(["--grpo.group_size=1", "--sampling.temperature=-1", "--env.max_turns=0"])
    with pytest.raises(C.ConfigError) as e:
        config_checks.validate(cfg)
    msg = str(e.value)
    assert msg.startswith("3 problems:")
    for key in ("grpo.group_size must be >= 2, got 1", "sampling.temperature must be > 0, got -1.0",
                "env.max_turns must be >= 1, got 0"):
        assert key in msg, msg
    assert len(msg.splitlines()) == 4  # a header, then one line per problem


def test_prompts_per_step_divisible_by_the_world_size():
    cfg = C.load_config(["--grpo.prompts_per_step=7"])
    config_checks.validate(cfg, world=1)
    with pytest.raises(C.ConfigError, match=r"grpo.prompts_per_step=7 must be divisible by the world size 2"):
        config_checks.validate(cfg, world=2)


@pytest.mark.parametrize("overrides,match", [
    (["--sampling.kv_budget_tokens=1000", "--sampling.max_context=2000"], "kv_budget_tokens=1000 must hold"),
    (["--grpo.rollout_is_low=5", "--grpo.rollout_is_high=2"], "rollout_is_low .* below"),
    (["--grpo.dual_clip_c=0.5"], "dual_clip_c must be 0 .* or > 1"),
    (["--reward.correct=0", "--reward.wrong=0"], "reward.correct .* above reward.wrong"),
    (["--reward.dense_step_min=0.6"], "reward.dense_step_min .* not be above reward.dense_step_max"),
    (["--model.tiny_hidden_size=100", "--model.tiny_heads=3"], "tiny_hidden_size=100 must be"),
    (["--model.tiny_heads=4", "--model.tiny_kv_heads=3"], "tiny_heads=4 must be a multiple"),
    (["--env.fetch_rows=10", "--env.max_result_rows=50"], "env.fetch_rows=10 must be at least"),
    (["--model.lora_rank=8", "--model.lora_targets=q,x"], "model.lora_targets"),
    (["--train.out_dir="], "train.out_dir must not be empty"),
    (["--wandb.mode=offline", "--wandb.project="], "wandb.project"),
    (["--env.obs_template=<o>{result} {turn_left}</o>"], "env.obs_template names turn_left"),
    (["--env.error_text=Error: {error"], "env.error_text is not a format string"),
    (["--optim.lr=.inf"], "optim.lr must be > 0, got inf"),
    # a credit's key set while grpo.credit picks another (the lookup bonus used to be switched on by its size)
    (["--grpo.lookup_bonus=0.2"], r"grpo.lookup_bonus=0.2 is read by the lookup_bonus credit only, and grpo.credit "
                                  r"is outcome: pick it with grpo.credit=lookup_bonus"),
    (["--grpo.credit=lookup_bonus", "--grpo.turn_discount=0.9"], "grpo.turn_discount=0.9 is read by the turn_discount"),
    (["--grpo.credit=lookup_bonus"], r"grpo.credit=lookup_bonus reads grpo.lookup_bonus, left at 0.0: off"),
    (["--grpo.loss=cispo", "--grpo.dual_clip_c=3"], "dual-clip caps a PPO-clip loss, and grpo.loss=cispo has none"),
    # SAPO's gate has no clip: a clip key set for it would be accepted and ignored
    (["--grpo.loss=sapo", "--grpo.clip_high=0.28"], r"grpo.loss=sapo has no clip: .* must stay < 0"),
    (["--grpo.loss=sapo", "--grpo.clip_low=0.2"], r"grpo.loss=sapo has no clip: .* must stay < 0"),
    # a correction reading the tokens' ages on synchronous steps (every age 0), or masking none of them
    (["--grpo.rollout_is=age-mask"], r"grpo.rollout_is=age-mask reads each token's age, and with "
                                     r"stream.sampling_steps_ahead=0"),
    (["--grpo.rollout_is=age-mask", "--stream.sampling_steps_ahead=1"], "age-mask would mask nothing"),
])
def test_keys_that_must_agree(overrides, match):
    with pytest.raises(C.ConfigError, match=match):
        config_checks.validate(C.load_config(overrides))


# Each rule between keys at its boundary: the equal (or just-inside) value passes or fails as the
# rule's words say ("must hold", "at least", "not above": equal passes; "below", "above", "> 1":
# equal fails), and one step past the boundary fails
@pytest.mark.parametrize("overrides,world,error", [
    (["--grpo.prompts_per_step=2"], 2, None),  # one prompt per rank
    (["--grpo.prompts_per_step=3"], 2, "grpo.prompts_per_step=3 must be divisible by the world size 2"),
    (["--grpo.prompts_per_step=16"], 16, None),
    (["--grpo.dual_clip_c=1.0"], 1, r"grpo.dual_clip_c must be 0 \(off\) or > 1, got 1.0"),
    (["--grpo.dual_clip_c=1.01"], 1, None),
    (["--grpo.rollout_is_low=2", "--grpo.rollout_is_high=2"], 1, r"rollout_is_low \(2.0\) must be below"),
    (["--grpo.rollout_is_low=1.99", "--grpo.rollout_is_high=2"], 1, None),
    (["--sampling.kv_budget_tokens=2000", "--sampling.max_context=2000"], 1, None),
    (["--sampling.kv_budget_tokens=1999", "--sampling.max_context=2000"], 1, "kv_budget_tokens=1999 must hold"),
    (["--reward.correct=0.5", "--reward.wrong=0.5"], 1, r"reward.correct \(0.5\) must be above"),
    (["--reward.correct=0.51", "--reward.wrong=0.5"], 1, None),
    (["--reward.dense_step_min=0.5", "--reward.dense_step_max=0.5"], 1, None),
    (["--reward.dense_step_min=0.51", "--reward.dense_step_max=0.5"], 1, "dense_step_min .* not be above"),
    # fetch_rows against both protocols' shown rows: the tags one (max_result_rows) and the actions
    # protocol's own QUERY limit (actions_max_result_rows), whichever is larger
    (["--env.fetch_rows=50", "--env.max_result_rows=50", "--env.actions_max_result_rows=20"], 1, None),
    (["--env.fetch_rows=49", "--env.max_result_rows=50", "--env.actions_max_result_rows=20"], 1,
     "env.fetch_rows=49 must be at least"),
    (["--env.fetch_rows=60", "--env.max_result_rows=10", "--env.actions_max_result_rows=60"], 1, None),
    (["--env.fetch_rows=59", "--env.max_result_rows=10", "--env.actions_max_result_rows=60"], 1,
     r"env.fetch_rows=59 must be at least .* env.actions_max_result_rows \(60\)"),
    # the tiny model's head size: hidden / heads, and even (rotary embeddings rotate pairs)
    (["--model.tiny_hidden_size=16", "--model.tiny_heads=4", "--model.tiny_kv_heads=2"], 1, None),
    (["--model.tiny_hidden_size=12", "--model.tiny_heads=4", "--model.tiny_kv_heads=2"], 1,
     r"model.tiny_hidden_size=12 must be model.tiny_heads \(4\) x an even head size"),
    # the warm start stops after N passing checks in a row: N = 0 would stop before any check
    (["--sft.stop_checks_in_a_row=1"], 1, None),
    (["--sft.stop_checks_in_a_row=0"], 1, r"sft.stop_checks_in_a_row must be >= 1, got 0"),
    # each credit with its own key; γ = 1 is no discount, 0 would zero every turn but the last
    (["--grpo.credit=lookup_bonus", "--grpo.lookup_bonus=0.2"], 1, None),
    (["--grpo.credit=turn_discount", "--grpo.turn_discount=0.99"], 1, None),
    (["--grpo.credit=turn_discount", "--grpo.turn_discount=1.0"], 1, "grpo.credit=turn_discount reads grpo.turn_discount"),
    (["--grpo.credit=turn_discount", "--grpo.turn_discount=0.0"], 1, r"grpo.turn_discount must be \(0, 1\]"),
    (["--grpo.loss=gspo", "--grpo.dual_clip_c=3"], 1, None),
    # age-mask's N below k: it masks the tokens N + 1 .. k steps old
    (["--grpo.rollout_is=age-mask", "--stream.sampling_steps_ahead=2", "--grpo.rollout_is_max_age=1"], 1, None),
    (["--grpo.rollout_is=age-mask", "--stream.sampling_steps_ahead=2", "--grpo.rollout_is_max_age=2"], 1,
     r"grpo.rollout_is_max_age=2: no trained token is older than stream.sampling_steps_ahead=2"),
])
def test_rules_between_keys_at_their_boundaries(overrides, world, error):
    cfg = C.load_config(overrides)
    if error is None:
        config_checks.validate(cfg, world)
    else:
        with pytest.raises(C.ConfigError, match=error):
            config_checks.validate(cfg, world)


def test_a_loss_declared_without_a_clip_refuses_one(monkeypatch):
    """A loss whose declaration has no clip (trainer/losses.py) would ignore grpo.clip_low/clip_high:
    the config says so instead. Checked on a registered stand-in, so it holds for any such loss."""
    from trainer.losses import LOSSES, LossSpec
    monkeypatch.setitem(LOSSES, "no-clip", LossSpec("no-clip", LOSSES["grpo"].fn, None, False, False))
    cfg = C.Config()
    cfg.grpo.loss = "no-clip"
    config_checks.validate(cfg)
    cfg.grpo.clip_high = 0.28
    with pytest.raises(C.ConfigError, match=r"grpo.loss=no-clip has no clip: .* must stay < 0"):
        config_checks.validate(cfg)


def test_a_yaml_syntax_error_is_one_line_with_its_place(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("grpo:\n  group_size: 4\n  loss: [grpo\n")
    with pytest.raises(C.ConfigError) as e:
        C.load_config([str(p)])
    assert str(e.value).startswith(f"{p}: YAML syntax error at line 4, column 1:") and "\n" not in str(e.value)


def test_model_folder_checks(tmp_path):
    from model import Transformer
    from toy import tiny
    good = tmp_path / "good"
    tiny.build_tiny(Transformer, str(good), vocab_size=300, hidden_size=16, layers=1, heads=2, kv_heads=1)
    config_checks.check_model_folder(str(good))
    with pytest.raises(C.ConfigError, match="model.path .*nope: no such folder"):
        config_checks.check_model_folder(str(tmp_path / "nope"))
    only_config = tmp_path / "only_config"  # once: "chat_template is not set" from deep inside
    only_config.mkdir()
    shutil.copy(good / "config.json", only_config)
    with pytest.raises(C.ConfigError, match="--model .*only_config: no tokenizer"):
        config_checks.check_model_folder(str(only_config), "--model")
    no_template = tmp_path / "no_template"
    shutil.copytree(good, no_template)
    tc = json.loads((no_template / "tokenizer_config.json").read_text())
    del tc["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(C.ConfigError, match="no chat template"):
        config_checks.check_model_folder(str(no_template))
    (no_template / "config.json").unlink()
    with pytest.raises(C.ConfigError, match="no config.json"):
        config_checks.check_model_folder(str(no_template))


def run_train(args, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_train_refuses_a_bad_config_before_anything_runs(tmp_path):
    """Before: exit 0 after a whole run with group_size 1 ('equal rewards: no update' every step).
    Now: one line on stderr, exit 1, and nothing written: no toy set, no model, no out_dir."""
    out = tmp_path / "run"
    p = run_train(["configs/tiny.yaml", "--grpo.group_size=1", f"--train.out_dir={out}",
                   f"--model.path={tmp_path}/model", f"--data.db_root={tmp_path}/toy",
                   f"--data.train_path={tmp_path}/toy/train.jsonl", f"--data.eval_path={tmp_path}/toy/eval.jsonl"])
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and p.stderr.startswith(
        "config error: grpo.group_size must be >= 2, got 1"), p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert not any(tmp_path.iterdir())  # no out_dir, toy set or model: nothing ran


def test_train_refuses_a_missing_model_before_the_process_group(tmp_path, monkeypatch):
    """build_tiny false and no model there: this was gloo's "Connection closed by peer" on the
    other ranks (rank 0 failed inside prepare_assets while they waited at a barrier)."""
    import train
    monkeypatch.setattr(sys, "argv", ["train.py", "configs/tiny.yaml", "--model.build_tiny=false",
                                      f"--model.path={tmp_path}/missing", f"--train.out_dir={tmp_path}/run"])
    with pytest.raises(C.ConfigError, match=f"^model.path {tmp_path}/missing: no such folder$"):
        train.main()
    assert not (tmp_path / "run").exists()  # before the out_dir lock, the process group, anything

