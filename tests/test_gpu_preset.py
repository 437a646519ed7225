"""The GPU presets of bench/gpu.sh, dry-run on the CPU: a GPU loan is 15 minutes in all, so a typo
in a flag or a script must not be found on the GPU machine. SMOKE=1 runs every part of the three
presets, vs_trl and smollm2 with a tiny model on the toy set (the CUDA-only settings are ignored on CPU; the suite part
only collects) and every part must exit 0 and print its headline figures.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(1200)  # its child run is bounded at 900 s itself
def test_the_presets_run_on_cpu(tmp_path):
    out = tmp_path / "gpu"
    env = {**os.environ, "SMOKE": "1", "PARTS": "engine first second vs_trl smollm2", "RUNS": str(tmp_path / "runs"),
           "PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    if not Path(env["PYTHON"]).exists():
        env["PYTHON"] = "python3"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text()
    exits = dict(re.findall(r"^--- (\w+): exit (\d+)", summary, re.M))
    parts = ["decode05", "decode7b", "grpo_run", "grpo_resume", "decode", "lora_run", "rollout_vs_generate",
             "decode_profile", "tests", "vs_trl", "smollm2"]
    assert sorted(exits) == sorted(parts), (exits, proc.stdout[-3000:])
    failed = {name: (out / f"{name}.txt").read_text()[-2000:] for name, rc in exits.items() if rc != "0"}
    assert not failed, failed
    for headline in ("grpo_steps_logged: 1", "resumed_last_step: 2", "resumed_repeated_steps: 0", "lora_steps_logged: 1", "smollm2_steps_logged: 1",
                     "resumed_first_rollout_over_steady:", "decode_tok_s_smoke_b4", "rollout_speedup_vs_generate:",
                     "launches_per_decode_step_smoke", "step_speedup_vs_trl:"):
        assert headline in summary, (headline, summary)


def test_run_summary_reads_a_step_that_trained_no_group():
    """Dynamic sampling can drop every group of a step: train.py then logs no time/update for it.
    run_summary counts that step's update as 0 s instead of failing (the smollm2 part's smoke step
    is such a step)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import run_summary
    rows = [{"step": 1, "time/step": 9.0, "time/rollout": 6.0, "time/reward": 0.0, "time/update": 3.0,
             "train/tokens_per_s": 10.0},
            {"step": 2, "time/step": 4.0, "time/rollout": 4.0, "time/reward": 0.0, "train/tokens_per_s": 10.0},
            {"step": 3, "time/step": 8.0, "time/rollout": 5.0, "time/reward": 0.0, "time/update": 3.0,
             "train/tokens_per_s": 12.0}]
    lines = dict(line.split(": ") for line in run_summary.summary(rows, "", "p"))
    assert lines["p_update_s"] == "1.50" and lines["p_rollout_s"] == "4.50" and lines["p_steps_logged"] == "3"
