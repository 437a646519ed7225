"""Every recipe in configs/ stays runnable: it loads (config.load_config), its paths have the right
shape, and it runs one tiny GRPO step when its model and data paths are pointed at the embedded
default's (the toy set + a tiny random model, built once for all configs). Everything else (the
protocol, the conversation format, SFT, KL, dynamic sampling, activation checkpointing, the loss)
stays as the config says, so a recipe that rots fails here. ~1 min on 2 cores, one process.

    .venv/bin/pytest tests/test_configs.py -q
"""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, build_tiny_assets

import config as C
from toy import tiny
import train

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

# the sizes of a tiny step; every other key keeps the recipe's value
SMALL = ["--model.dtype=float32", "--wandb.mode=disabled", "--train.steps=1", "--train.eval_every=0",
         "--train.save_every=0", "--train.sample_every=1", "--train.resume=false", "--train.threads=0",
         "--grpo.prompts_per_step=2", "--grpo.group_size=2", "--grpo.max_resample_rounds=1",
         "--sampling.max_new_tokens=12", "--sampling.max_context=2048", "--sampling.kv_budget_tokens=100000",
         "--data.max_eval_examples=2", "--data.max_train_examples=8", "--env.workers=1",
         "--optim.micro_batch_tokens=4096"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The toy set and a tiny model, built once (tiny.prepare_assets, as a run would)."""
    return ["--" + a for a in build_tiny_assets(tmp_path_factory.mktemp("assets"))]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_with_paths_of_the_right_shape(path):
    cfg = C.load_config([str(path)])
    text = path.read_text()
    assert text.startswith("#"), f"{path.name}: open with a comment saying what the recipe is and how to run it"
    assert f"train.py configs/{path.name}" in text.split("\nmodel:")[0], f"{path.name}: header lacks its command"
    assert cfg.model.path and not cfg.model.path.endswith((".json", ".safetensors")), "model.path is a folder"
    header = text.split("\nmodel:")[0]
    if not cfg.model.build_tiny and cfg.model.path.startswith("runs/"):  # a folder a data/ script writes
        assert re.search(rf"data/prepare_\w+\.py .*--out {re.escape(cfg.model.path)}\b", header), \
            f"{path.name}: a real model under runs/ needs the command that builds it in the header"
    for p in (cfg.data.train_path, cfg.data.eval_path, *([cfg.data.unseen_eval_path] if cfg.data.unseen_eval_path else [])):
        assert p.endswith(".jsonl"), f"{path.name}: {p} is not a canonical jsonl (sqltask/dataset.py)"
    assert cfg.data.db_root and cfg.train.out_dir.startswith("runs/")
    if not cfg.data.prepare_toy:  # a real data set: its files are prepared by a script in data/
        assert not cfg.data.train_path.startswith("runs/toy")
    for group, keys in yaml.safe_load(text).items():  # every key of the file reached the config
        for k, v in keys.items():
            got = getattr(getattr(cfg, group), k)
            assert got == (float(v) if isinstance(got, float) else v), f"{group}.{k}"


def test_configs_have_their_own_out_dirs():
    out = [C.load_config([str(p)]).train.out_dir for p in CONFIGS]
    assert len(set(out)) == len(out), out


def test_conversation_recipe_differs_only_in_format():
    base = C.to_dict(C.load_config([str(ROOT / "configs/skyrl_sql_7b.yaml")]))
    conv = C.to_dict(C.load_config([str(ROOT / "configs/skyrl_sql_7b_conversation.yaml")]))
    diff = {f"{g}.{k}" for g in base for k in base[g] if base[g][k] != conv[g][k]}
    assert diff == {"env.conversation", "train.out_dir", "wandb.name"}
    assert conv["env"]["conversation"] == "conversation"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_runs_one_tiny_step(path, assets, tmp_path, monkeypatch, capsys):
    recipe = C.load_config([str(path)])
    out = tmp_path / "run"
    sft = [f"--sft.steps={min(recipe.sft.steps, 1)}", "--sft.batch_size=2"]
    live = ["--train.plot_every=1"] if path.stem == "tiny" else []  # train.py's live plot hook, once
    argv = [str(path), *assets, *SMALL, *sft, *live, f"--train.out_dir={out}"]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    train.main()
    log = capsys.readouterr().out
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in recs for k in r}
    assert {"train/reward", "train/kept_frac", "eval/ex", "eval/random_ex", "run/done"} <= keys, keys
    assert recs[-1] == {"step": 1, "run/done": 1.0}
    assert "[random baseline] EX" in log and "--- sample" in log and "tool calls" in log
    if recipe.sft.steps:
        assert "sft/loss" in keys
    if recipe.model.lora_rank:  # the run trained the adapters only, saved in PEFT's format
        assert f"LoRA: rank {recipe.model.lora_rank}, alpha {recipe.model.lora_alpha:g}" in log, log[-2000:]
        assert (out / "ckpt_000001" / "adapter" / "adapter_model.safetensors").exists()
        m = re.search(r"model: ([\d.]+)M params, ([\d.]+)M trainable", log)
        assert m and 0 < float(m[2]) < float(m[1]) / 2, log[-2000:]
    if live and importlib.util.find_spec("matplotlib"):
        assert (out / "metrics.png").stat().st_size > 10_000
    # the run used the recipe's settings (only the sizes and paths above were changed)
    saved = yaml.safe_load((out / "ckpt_000001" / "config.yaml").read_text())
    for group in ("env", "reward", "grpo"):
        want = C.to_dict(C.load_config([str(path), *SMALL]))[group]
        assert saved[group] == want, group
    assert saved["model"]["activation_checkpointing"] == recipe.model.activation_checkpointing
    assert saved["env"]["protocol"] == recipe.env.protocol
    assert saved["env"]["conversation"] == recipe.env.conversation
    assert Path(saved["model"]["path"]).parent == Path(assets[4].split("=", 1)[1]).parent


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_warm_start_writes_well_formed_episodes_in_its_protocol(path, assets):
    """The SFT warm start's gold episodes, as the recipe renders them (its protocol, conversation
    format, turns, think text) on toy records with and without a lookup: well formed and the full
    reward (dense shaping included), with the lookup whenever the recipe has a turn for it."""
    from transformers import AutoTokenizer

    import reward
    import rollout
    import sft
    from sqltask import chat, dataset
    cfg = C.load_config([str(path), *assets, "--env.workers=1"])
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    train_ex = dataset.load_examples(cfg.data.train_path, cfg.data.db_root)
    recs = [r for r in train_ex if r["lookup_sql"]][:4] + [r for r in train_ex if not r["lookup_sql"]][:4]
    dbs = [dataset.abs_db_path(r, cfg.data.db_root) for r in recs]
    prompts = [chat.render_prompt(tok, r, cfg.data, cfg.env.protocol, cfg.data.db_root) for r in recs]
    eps = sft.gold_episodes(recs, prompts, tok, cfg, dbs)
    scores = reward.episode_rewards([rollout.transcript(e, r, cfg.data.db_root) for r, e in zip(recs, eps)],
                                    cfg.reward, cfg.env.protocol, chat.conversation_pieces(tok, cfg.env))
    for r, e, s in zip(recs, eps, scores):
        assert s.format_ok and s.exec_match and s.value >= cfg.reward.correct, (path.name, s, e.text)
        if r["lookup_sql"] and rollout_turns(cfg) > 1:  # the lookup's observation shows the code
            assert any(st["arg"] == r["lookup_sql"] for st in e.steps), (path.name, e.text)


def rollout_turns(cfg) -> int:
    import rollout
    return rollout.max_turns(cfg.env)
