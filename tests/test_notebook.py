"""notebooks/train_grpo.ipynb stays runnable: it is a valid nbformat v4 notebook saved without
outputs, and it executes top to bottom (nbclient + an IPython kernel) on the embedded default with a
reduced step count, drawing its live plot, the random baseline and a trace; section 7 shows a gold
warm-start episode in the actions protocol and, on a machine without a GPU, trains that protocol's
tiny config instead of Qwen3. ~2 min on 2 cores. Skips with a message when nbclient, nbformat,
ipykernel or matplotlib are absent (pip install -r requirements-dev.txt).

    .venv/bin/pytest tests/test_notebook.py -q
"""
import importlib.util
import json

import pytest
from conftest import ROOT

NOTEBOOK = ROOT / "notebooks" / "train_grpo.ipynb"
NEEDED = ("nbclient", "nbformat", "ipykernel", "matplotlib")
MISSING = [m for m in NEEDED if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the notebook test needs {', '.join(MISSING)} "
                                                      "(pip install -r requirements-dev.txt)")


def read():
    import nbformat
    return nbformat.read(str(NOTEBOOK), as_version=4)


def test_notebook_is_valid_and_clean():
    import nbformat
    nb = read()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "save the notebook without outputs"
    settings = [c for c in code if "GRPO_SQL_NOTEBOOK" in c.source]
    assert len(settings) == 1 and "CONFIG = \"configs/tiny.yaml\"" in settings[0].source
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= len(code) // 2  # each step is explained


def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    from nbclient import NotebookClient
    toy, model = tmp_path / "toy", tmp_path / "model"
    small = {
        "OUT_DIR": str(tmp_path / "run"),
        "ACTIONS_OUT_DIR": str(tmp_path / "run_actions"),  # section 7 without a GPU: configs/tiny_actions.yaml
        "EXTRA": [f"--data.train_path={toy}/train.jsonl", f"--data.eval_path={toy}/eval.jsonl",
                  f"--data.db_root={toy}", f"--model.path={model}", "--model.tiny_hidden_size=32",
                  "--model.tiny_layers=1", "--model.tiny_heads=2", "--model.tiny_kv_heads=1",
                  "--model.tiny_intermediate_size=64", "--model.tiny_vocab_size=512",
                  "--sft.steps=2", "--sft.batch_size=4", "--train.steps=2", "--grpo.prompts_per_step=4",
                  "--grpo.group_size=2", "--sampling.max_new_tokens=16", "--data.max_eval_examples=4",
                  "--train.eval_every=1", "--train.sample_every=1", "--train.threads=0"],
        "POLL_S": 0.5,
        "QWEN3_PATH": str(tmp_path / "no_model"),  # the GPU section must skip itself
    }
    monkeypatch.setenv("GRPO_SQL_NOTEBOOK", json.dumps(small))
    nb = read()
    run_in = {"metadata": {"path": str(NOTEBOOK.parent)}}  # the folder a user opens it from
    NotebookClient(nb, timeout=300, kernel_name="python3", resources=run_in).execute()

    def text(i):
        return "".join(o.get("text", "") for o in nb.cells[i].outputs if o.output_type == "stream")

    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    out = {i: text(i) for i in code}
    baseline = next(t for t in out.values() if "random baseline on 4 held-out questions: EX" in t)
    assert "--- a random episode" in baseline
    live = next(i for i in code if "train_live(CONFIG" in nb.cells[i].source)
    pngs = [o for o in nb.cells[live].outputs if "image/png" in o.get("data", {})]
    assert pngs, "the live plot was never drawn"
    assert "world 2" in out[live]  # the default NPROC=2: torchrun, two CPU ranks
    assert "step 2/2" in out[live] and "--- sample" in out[live] and "[random baseline] EX" in out[live]
    assert out[live].startswith("memory estimate") and "protocol:" not in out[live]  # config dump skipped
    assert any("held-out EX: random baseline" in t and "end (step 2)" in t for t in out.values())
    assert any("section 7 skipped: needs" in t and "QWEN3_PATH" in t for t in out.values())
    # section 7: a gold warm-start episode in the actions protocol, then that protocol trained on CPU
    gold = next(t for t in out.values() if "--- a gold warm-start episode (actions protocol" in t)
    assert "<action>DESCRIBE" in gold and "<action>ANSWER" in gold and "exec True" in gold, gold
    actions = [json.loads(line) for line in (tmp_path / "run_actions" / "metrics.jsonl").read_text().splitlines()]
    assert actions[-1] == {"step": 2, "run/done": 1.0} and any("eval/random_ex" in r for r in actions)
    assert sum("held-out EX: random baseline" in t for t in out.values()) == 2
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1] == {"step": 2, "run/done": 1.0}
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 10_000
