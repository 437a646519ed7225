"""trainer/memory.py: the auto KV budget (vLLM's gpu_memory_utilization, over what the run leaves), the
refusal of a config that cannot fit (one line, before anything large is allocated), and the device's
memory as the kernel reports it.

    .venv/bin/python -m pytest -q tests/test_memory.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import config as C
from conftest import ROOT, build_tiny_assets
from model import ModelArgs, Transformer
from trainer import memory

CPU = torch.device("cpu")
GB = 1024 ** 3


def smollm2_shape() -> Transformer:
    """SmolLM2-135M's shape on the meta device: 30 layers, 3 KV heads of 64, float32 = 46,080 B a token."""
    args = ModelArgs(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    with torch.device("meta"):
        return Transformer(args)


def test_kv_bytes_per_token_is_k_and_v_over_every_layer():
    model = smollm2_shape()
    assert memory.kv_bytes_per_token(model.config, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert memory.kv_bytes_per_token(model.config, torch.bfloat16) == 23040


def test_auto_takes_the_fraction_of_what_the_run_leaves_in_whole_blocks_capped_by_the_work():
    cfg = C.load_config(["--sampling.max_context=2048", "--sampling.kv_memory_fraction=0.5"])
    assert cfg.sampling.kv_budget_tokens == "auto"  # the default
    kv_bytes = 46080
    # 10 GB free, 4 GB still needed elsewhere: half of the 6 GB left, in blocks of 16 tokens
    tokens = memory.kv_budget(cfg.sampling, 4.0, kv_bytes, CPU, 10 ** 9, available=(10.0, "test"))
    by_hand = int(0.5 * 6 * GB // kv_bytes) // 16 * 16
    assert tokens == by_hand == 69904
    # a machine with room to spare gets what the work can use, in whole blocks, and no more
    assert memory.kv_budget(cfg.sampling, 4.0, kv_bytes, CPU, 5000, available=(500.0, "test")) == 5008
    # a number is taken as given (the estimate then checks it)
    cfg.sampling.kv_budget_tokens = 1234
    assert memory.kv_budget(cfg.sampling, 4.0, kv_bytes, CPU, 10 ** 9, available=(1.0, "test")) == 1234


def test_auto_that_cannot_hold_one_sequence_stops_naming_the_keys():
    cfg = C.load_config(["--sampling.max_context=4096"])
    with pytest.raises(C.ConfigError) as e:
        memory.kv_budget(cfg.sampling, 7.9, 46080, CPU, 10 ** 9, available=(8.0, "available RAM"))
    line = str(e.value)
    assert "\n" not in line and line.startswith("sampling.kv_budget_tokens=auto: 8.0 GB available RAM, 7.9 GB")
    assert "sampling.max_context=4096" in line and "optim.micro_batch_tokens" in line


def test_work_tokens_counts_the_rows_a_rank_holds_at_once():
    cfg = C.load_config(["--grpo.prompts_per_step=16", "--grpo.group_size=4", "--sampling.max_context=1000"])
    assert memory.work_tokens(cfg, 2, n_eval=30) == 8 * 4 * 1000  # a round's groups
    assert memory.work_tokens(cfg, 2, n_eval=203) == 102 * 1000  # an eval's share
    cfg.stream.sampling_steps_ahead = 1  # one more chunk's share open
    assert memory.work_tokens(cfg, 2, n_eval=30) == 2 * 8 * 4 * 1000


def test_a_config_over_the_memory_stops_with_one_line_naming_estimate_memory_and_keys():
    model = smollm2_shape()
    cfg = C.load_config(["--sampling.kv_budget_tokens=1000000", "--model.fsdp_unit=model"])
    est = memory.memory_estimate(model, cfg, world=1)
    assert est["kv_cache"] == pytest.approx(1_000_000 * 46080 / GB)  # the 46 GB pool
    with pytest.raises(C.ConfigError) as e:
        memory.check_fits(est, CPU, 0.5, available=(20.0, "available RAM"))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"memory: this config needs about {est['total']:.1f} GB per rank, 20.5 GB is available RAM")
    assert "kv_cache 42.9 GB: sampling.kv_budget_tokens (or auto)" in line  # the largest part first
    memory.check_fits(est, CPU, 0.5, available=(est["total"], "available RAM"))  # fits: no error


def test_size_kv_pool_resolves_auto_into_the_estimate_and_the_sampler_config():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    cfg = C.load_config(["--sampling.max_context=256", "--grpo.prompts_per_step=4", "--grpo.group_size=2"])
    lines = []
    sampling_cfg, est = memory.size_kv_pool(model, cfg, 1, CPU, n_eval=3, say=lines.append)
    assert sampling_cfg.kv_budget_tokens == 8 * 256  # plenty of memory: the work's 8 rows x max_context
    assert cfg.sampling.kv_budget_tokens == "auto"  # the run's config keeps what the user wrote
    kv_bytes = memory.kv_bytes_per_token(model.config, torch.float32)
    assert est["kv_cache"] == pytest.approx(8 * 256 * kv_bytes / GB)
    assert lines[0].startswith("sampling.kv_budget_tokens=auto: 2048 tokens") and lines[1].startswith("memory estimate")


def test_available_memory_on_cpu_is_memavailable_shared_by_the_ranks_on_the_host():
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(meminfo["MemTotal"].split()[0]) * 1024 / GB
    one, where = memory.available_gb(CPU, local_ranks=1)
    two, where2 = memory.available_gb(CPU, local_ranks=2)
    assert 0 < one <= total and where == "available RAM" and where2 == "available RAM / 2 ranks on this host"
    assert two == pytest.approx(one / 2, rel=0.1)  # MemAvailable moves a little between two reads


def run(args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_eval_generate_with_a_budget_over_the_memory_stops_before_allocating(tmp_path):
    """A KV budget larger than the machine (here 10^12 tokens): one line and exit 1, not the OOM killer."""
    assets = dict(a.split("=", 1) for a in build_tiny_assets(tmp_path))
    common = ["eval.py", "generate", "--model", assets["model.path"], "--data", assets["data.eval_path"],
              "--db-root", assets["data.db_root"], "--limit", "2", "--out", str(tmp_path / "out")]
    r = run(common + ["--sampling.kv_budget_tokens=1000000000000"])
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() + r.stderr.splitlines() if ln.strip()]
    assert any(ln.startswith("config error: memory: this config needs about") and "sampling.kv_budget_tokens" in ln
               for ln in lines), lines[-5:]
    assert "Traceback" not in r.stderr
    # the default (auto) runs on the same machine
    r = run(common)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KV pool" in r.stdout and "sampling.kv_budget_tokens=auto" in r.stdout
