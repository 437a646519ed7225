"""checkpoint.py's trainer state: plain data that torch.load(weights_only=True) reads, so a shared
checkpoint cannot run code on resume. A trainer.pt that pickles anything else (here: an object
whose unpickling writes a file) is refused with one line naming it, and nothing runs; an older
checkpoint of this project (numpy RNG state as an ndarray) still resumes.

    .venv/bin/pytest -q tests/test_checkpoint.py
"""
import builtins
import pickle
import random

import numpy as np
import pytest
import torch

from trainer import checkpoint
import config as C
from trainer import optim
from trainer import runguard
from toy import tiny
from model import Transformer
from test_train import run_train, small_args


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny(Transformer, str(d), None, vocab_size=300, hidden_size=32, layers=1, heads=2, kv_heads=1, seed=0)
    return str(d)


def trained(path, lr=1e-2):
    """A model, its AdamW and schedule after one step (non-zero moments, a moved schedule)."""
    torch.manual_seed(0)
    model = Transformer.from_pretrained(path)
    opt, sch = optim.make_optimizer(model, C.OptimConfig(), lr, 2, 10)
    model(torch.tensor([[1, 2, 3, 4]])).sum().backward()
    optim.step_optimizer(model, opt, sch, C.OptimConfig())
    return model, opt, sch


def draws():
    """One number from each RNG a checkpoint restores."""
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


class WritesAFile:
    """Unpickling it writes `path` (what a crafted checkpoint could do: run any code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.exec, (f"open({self.path!r}, 'w').write('pwned')",)


def test_trainer_state_is_plain_data_and_resumes_exactly(tmp_path, tiny_dir):
    cfg = C.load_config([f"--model.path={tiny_dir}"])
    model, opt, sch = trained(tiny_dir)
    ck = checkpoint.save(str(tmp_path), 1, model, opt, sch, None, cfg, {"cursor": 7, "log_sizes": {"m": 3}})
    after_save = draws()
    blob = torch.load(f"{ck}/trainer.pt", weights_only=True)  # no safe_globals needed: plain types only
    assert torch.serialization.get_unsafe_globals_in_checkpoint(f"{ck}/trainer.pt") == []
    assert blob["step"] == 1 and blob["extra"] == {"cursor": 7, "log_sizes": {"m": 3}}
    fresh, fresh_opt, fresh_sch = trained(tiny_dir, lr=1e-3)  # other moments and lr
    draws()  # the RNGs moved on
    extra = checkpoint.load(ck, fresh, fresh_opt, fresh_sch)
    assert extra == {"step": 1, "cursor": 7, "log_sizes": {"m": 3}}
    assert draws() == after_save  # torch, numpy and Python RNGs as they were at the save
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert fresh_sch.state_dict() == sch.state_dict() and fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_an_older_checkpoint_of_this_project_still_resumes(tmp_path, tiny_dir):
    """Before: numpy's RNG state as its tuple with an ndarray, Python's as a tuple, pickled as they are."""
    cfg = C.load_config([f"--model.path={tiny_dir}"])
    model, opt, sch = trained(tiny_dir)
    ck = checkpoint.save(str(tmp_path), 2, model, opt, sch, None, cfg, {"cursor": 0})
    blob = torch.load(f"{ck}/trainer.pt", weights_only=True)
    blob["rng"] = [{"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "cuda": None}]
    want = draws()
    torch.save(blob, f"{ck}/trainer.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(f"{ck}/trainer.pt")  # numpy's: not plain
    draws()
    assert checkpoint.load(ck, model, opt, sch)["step"] == 2
    assert draws() == want


def test_a_trainer_pt_that_runs_code_is_refused_and_nothing_runs(tmp_path, tiny_dir):
    cfg = C.load_config([f"--model.path={tiny_dir}"])
    model, opt, sch = trained(tiny_dir)
    ck = checkpoint.save(str(tmp_path), 3, model, opt, sch, None, cfg, {"cursor": 0})
    # the payload is real: a plain unpickling writes its file
    pickle.loads(pickle.dumps(WritesAFile(tmp_path / "proof")))
    assert (tmp_path / "proof").read_text() == "pwned"
    marker = tmp_path / "pwned"
    blob = torch.load(f"{ck}/trainer.pt", weights_only=True)
    blob["extra"]["note"] = WritesAFile(marker)  # torch.save format, one object hidden in the extras
    torch.save(blob, f"{ck}/trainer.pt")
    with pytest.raises(runguard.RunError, match=rf"^{ck}/trainer.pt refused: it pickles builtins.exec, .*"
                                                r"nothing was loaded or run"):
        checkpoint.load(ck, model, opt, sch)
    assert not marker.exists()
    with open(f"{ck}/trainer.pt", "wb") as fh:  # a plain pickle file (not torch.save's zip)
        pickle.dump({"step": WritesAFile(marker)}, fh)
    with pytest.raises(runguard.RunError, match=r"is not a checkpoint file this project wrote"):
        checkpoint.load(ck, model, opt, sch)
    assert not marker.exists()


def test_resume_refuses_a_crafted_checkpoint_in_one_line(tmp_path):
    """The same command resumes from the out_dir's latest checkpoint: one whose trainer.pt was
    replaced by a crafted one stops the run with one line, exit 1, and its code never runs."""
    args = small_args(tmp_path) + ["--sft.steps=0"]
    p = run_train(args + ["--train.steps=0"], tmp_path / "run")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    ck = tmp_path / "run" / "ckpt_000000"
    blob = torch.load(ck / "trainer.pt", weights_only=True)
    marker = tmp_path / "pwned"
    blob["rng"][0]["python"] = WritesAFile(marker)
    torch.save(blob, ck / "trainer.pt")
    p = run_train(args + ["--train.steps=1"], tmp_path / "run")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 1, out[-3000:]
    assert out.strip().splitlines()[-1].startswith(f"error: {ck}/trainer.pt refused: it pickles builtins.exec"), \
        out[-3000:]
    assert "Traceback" not in out and not marker.exists()
    assert not (tmp_path / "run" / "ckpt_000001").exists()
