"""Shared test setup: the repo root on sys.path, the location of the real Spider data, the
launcher of the 2-rank checks (run_dist_check, report) and shared helpers."""
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

# Real Spider data (read-only). Tests that need it skip with this message when it is absent.
SPIDER = Path(os.environ.get("SPIDER_DIR", ROOT.parent / "shared" / "data" / "spider"))
SPIDER_MISSING = f"real Spider data not found at {SPIDER} (set SPIDER_DIR to use it)"
HAVE_SPIDER = (SPIDER / "dev.json").exists() and (SPIDER / "database").is_dir()


def pytest_sessionfinish(session, exitstatus):
    """test_precision and test_lora_train build the in-process one-rank gloo group and leave it up
    for the session. Close it before pytest exits: a gloo worker thread still letting go of a
    collective's tensors while the interpreter shuts down aborts the process, and pytest's exit
    status with it (distributed.close waits for it)."""
    if "trainer.distributed" in sys.modules:
        sys.modules["trainer.distributed"].close()


def torchrun_env(**extra: str) -> dict:
    """The environment for tests that start ranks under torchrun. They check CPU (gloo) equalities,
    so GPUs are hidden: on a CUDA machine each rank would otherwise take GPU LOCAL_RANK (NCCL) and
    2 ranks would need 2 GPUs. One thread per rank: 2 ranks on 2 cores, no oversubscription."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", **extra}


# -----------------------------------------------------------------------------
# 2-rank checks (tests/*_dist_check.py) under torchrun: each rank's results in a file of its own

RESULTS_ENV = "GRPO_SQL_CHECK_RESULTS"  # the folder run_dist_check gives the ranks for their results


def report(line: str) -> None:
    """One result line of a rank, for the test that launched it (run_dist_check): appended, whole, to
    this rank's own file <$GRPO_SQL_CHECK_RESULTS>/rank<RANK>.txt, and printed for a reader running
    the script by hand. Tests never parse the ranks' shared stdout: two ranks printing at once
    interleave their writes ("...moved=1RESULT rank=0 ..." came out as one line)."""
    print(line, flush=True)
    folder = os.environ.get(RESULTS_ENV)
    if folder:
        with open(Path(folder) / f"rank{os.environ.get('RANK', '0')}.txt", "a") as fh:
            fh.write(line + "\n")


@dataclass
class DistCheck:
    """How a run_dist_check ended: returncode (None: killed at its time limit), the output of
    torchrun and its ranks (interleaved: for a failure message only), each rank's report() lines."""
    returncode: int | None
    output: str
    results: dict[int, list[str]]

    def lines(self) -> list[str]:
        """Every rank's result lines, rank 0's first."""
        return [line for rank in sorted(self.results) for line in self.results[rank]]

    def why(self) -> str:
        """What a failed assertion shows: how it ended and the output's tail."""
        ended = "killed at its time limit" if self.returncode is None else f"exit status {self.returncode}"
        return f"{ended}; results {self.results}; output:\n{self.output[-4000:]}"


def _descendants(pid: int) -> list[int]:
    """Every live process below pid (children first found through /proc's parent ids)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        below = todo.pop()
        kids = [child for child, parent in parents.items() if parent == below]
        out += kids
        todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL pid and every process below it (torchrun's ranks run in sessions of their own, and the
    SQL pool's workers below them: a process group would miss them)."""
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Bounded(subprocess.Popen):
    """A Popen whose communicate(timeout=...) kills the process and everything below it when the time
    runs out, then raises TimeoutExpired as Popen does: a timed-out run's ranks and SQL workers
    would otherwise run on beside the rest of the suite and slow every later test."""

    def communicate(self, input=None, timeout=None):
        try:
            return super().communicate(input, timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.pid)
            super().communicate()
            raise


def run_dist_check(script: str, *args: str, nproc: int = 2, timeout: float = 240) -> DistCheck:
    """tests/<script> (or any script, given its absolute path) on nproc CPU ranks under torchrun
    (torchrun_env: gloo, one thread each), its results through report(). `--standalone`: torchrun's rendezvous store binds a free port itself,
    so concurrent launches (another test session, a training run) cannot clash. Bounded by
    `timeout` (below pytest's per-test limit, so a hang fails here with its output): past it
    torchrun and every rank are killed (the ranks run in sessions of their own, so they are found
    through /proc) and returncode is None."""
    with tempfile.TemporaryDirectory(prefix="dist_check_") as folder:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "tests" / script), *args]
        with open(Path(folder) / "output.txt", "w+") as out:
            p = subprocess.Popen(cmd, cwd=ROOT, env=torchrun_env(**{RESULTS_ENV: folder}), stdout=out,
                                 stderr=subprocess.STDOUT)
            try:
                returncode = p.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait()
                returncode = None
            out.seek(0)
            output = out.read()
        results = {int(f.stem[4:]): f.read_text().splitlines() for f in Path(folder).glob("rank*.txt")}
    return DistCheck(returncode, output, results)


def build_tiny_assets(d: Path) -> list[str]:
    """The toy set and a tiny model under d, built as a run builds them (tiny.prepare_assets).
    Returns the `group.key=value` settings that point a config at them (model.path is 5th)."""
    import config as C
    import sft
    from model import Transformer
    from toy import tiny
    settings = [f"data.train_path={d}/toy/train.jsonl", f"data.eval_path={d}/toy/eval.jsonl",
                f"data.db_root={d}/toy", "data.prepare_toy=true", f"model.path={d}/model",
                "model.build_tiny=true", "model.tiny_hidden_size=32", "model.tiny_layers=1",
                "model.tiny_heads=2", "model.tiny_kv_heads=1", "model.tiny_intermediate_size=64",
                "model.tiny_vocab_size=512"]
    tiny.prepare_assets(C.load_config(["--" + a for a in settings]), Transformer, sft.gold_texts)
    return settings


@pytest.fixture(scope="module")
def one_rank():
    """The process group of a one-rank run (gloo on CPU, 60-s collectives), for tests that drive FSDP2
    or the loss scaler in-process: the device."""
    from trainer import distributed
    rank, world, device = distributed.setup_dist(60)
    assert (rank, world) == (0, 1)
    return device


@pytest.fixture(scope="session")
def loop_assets(tmp_path_factory) -> list[str]:
    """The toy set and a tiny model, built once for the session: the `--group.key=value` arguments
    that point a run at them (tests/test_train.py's run_scripted_loop and its callers)."""
    return ["--" + a for a in build_tiny_assets(tmp_path_factory.mktemp("loop"))]


def loss_of(logp, old, adv, mask, *, norm, ref_logp=None, rollout_logp=None, entropy=None, turns=None,
            ages=None, max_len=0, agg=None, rollout_is=None, **grpo_keys):
    """grpo.policy_loss on loose (B, T) tensors, packed into the LossInputs the update builds.
    adv: (B,) per sequence (expanded over its tokens) or (B, T) per token; grpo_keys: grpo config
    keys (loss, clip_low, clip_high, dual_clip_c, kl_beta, ...) over GRPOConfig's defaults; agg:
    grpo.loss_agg; rollout_is: a rollout_correction.RolloutIS (its kind and bounds); ages: (B, T) long,
    each token's age (LossInputs.ages)."""
    import dataclasses

    import torch

    import grpo
    from config import GRPOConfig
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    turns = torch.zeros_like(mask, dtype=torch.long) if turns is None else turns
    if agg is not None:
        grpo_keys["loss_agg"] = agg
    if rollout_is is not None:
        grpo_keys.update(rollout_is=rollout_is.kind, rollout_is_cap=rollout_is.cap, rollout_is_low=rollout_is.low,
                         rollout_is_high=rollout_is.high, rollout_is_delta=rollout_is.delta,
                         rollout_is_max_age=rollout_is.max_age)
    g = dataclasses.replace(GRPOConfig(), **grpo_keys)
    inputs = grpo.LossInputs(logp, old, ref_logp, rollout_logp, mask, adv, turns, entropy, ages)
    return grpo.policy_loss(inputs, norm, g, max_len)


def grpo_update(model, ref_model, optimizer, scheduler, trajs, adv, cfg, world=1, device="cpu") -> dict:
    """One GRPO update as train.grpo_step runs it (train.update: mini-batches, packed micro-batches,
    grpo.policy_loss, backward, optimizer steps), on given trajectories and per-trajectory advantages
    adv (n,) (each spread over its loss tokens, grpo.token_advantages' default credit), with the loss
    scaler of cfg's compute dtype (active for float16 only). Returns the update's metrics."""
    import torch

    import train
    from trainer.distributed import compute_dtype
    from trainer.loss_scale import LossScaler
    per_token = [adv[i].expand(len(t.token_turns())).clone() for i, t in enumerate(trajs)]
    scaler = LossScaler(cfg.optim, compute_dtype(cfg))
    run = train.Run(model, ref_model, None, optimizer, scheduler, scaler, None, cfg, None, 0, world, torch.device(device))
    return train.update(run, trajs, per_token)
