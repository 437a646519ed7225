"""bench/float_paths.py's mechanism: a subprocess on another float path runs other kernels, and the
main command's warm start run there takes other floats, so the bench's rows are runs on other CPUs'
paths and not the same run twice. The bench itself (the warm start of seeds 0-2 on three paths, a few
minutes each) is run by hand; bench/RESULTS.md has its tables."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import float_paths  # noqa: E402

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX") and "avx2" in (
    Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "avx2")


def test_each_float_path_selects_its_kernels(monkeypatch):
    """torch in a subprocess on each path reports that path's kernels; a path variable inherited from
    the caller's environment does not reach the native run."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert "ATEN_CPU_CAPABILITY" not in float_paths.path_env("native")
    assert float_paths.capability("default") == "DEFAULT"
    if not HAS_AVX2:
        pytest.skip("this CPU has no AVX2: its native path is the default one")
    assert float_paths.capability("avx2") == "AVX2"
    assert float_paths.capability("native") not in ("DEFAULT", "")


@pytest.mark.timeout(400)
def test_the_warm_start_on_a_second_float_path_takes_other_floats(tmp_path):
    """The main command's warm start, shrunk (a smaller tiny model, 8 steps, one rank, no stop check):
    on the native path twice and on `default` once. The same path gives the same losses to the bit;
    `default` runs to the end with losses that differ (torch's unvectorised kernels add in another
    order, and its torch.randn gives the tiny model other initial weights): the bench's runs on a
    path are runs on other floats."""
    if not HAS_AVX2:
        pytest.skip("this CPU has no AVX2: its native path is the default one")
    args = ["--model.tiny_hidden_size=32", "--model.tiny_layers=1", "--model.tiny_heads=2",
            "--model.tiny_kv_heads=1", "--model.tiny_intermediate_size=64", "--model.tiny_vocab_size=400",
            f"--data.train_path={tmp_path}/toy/train.jsonl", f"--data.eval_path={tmp_path}/toy/eval.jsonl",
            f"--data.db_root={tmp_path}/toy", "--data.max_train_examples=64", "--data.max_eval_examples=8",
            "--sampling.max_new_tokens=24", "--sft.steps=8", "--sft.batch_size=8", "--sft.stop_at_train_ex=0",
            "--train.steps=0", "--train.threads=1"]
    runs = {name: float_paths.run_main_command(path, 0, tmp_path / name, args, nproc=1, timeout=120)
            for name, path in (("native", "native"), ("native_again", "native"), ("default", "default"))}
    for name, r in runs.items():
        assert r["rc"] == 0, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
        assert len(r["sft_losses"]) == 8 and all(math.isfinite(x) for x in r["sft_losses"]), r
        assert r["evals"] == 1 and r["stop"] is None  # the held-out eval after the warm start; no stop rule
    assert runs["native"]["sft_losses"] == runs["native_again"]["sft_losses"]
    assert runs["default"]["sft_losses"] != runs["native"]["sft_losses"]
