"""trainer/runguard.py and what it does to a run: one run per out_dir (a lock a kill -9 does not leave
stuck), SIGINT/SIGTERM stop at a step boundary with a checkpoint and one line, ranks stop when
torchrun is gone, a user error is one line on rank 0, metrics.jsonl never repeats a step.

Unit checks first (seconds); then one python train.py run stopped by SIGINT and resumed (~40 s),
then two torchrun runs (a data error; Ctrl-C then kill -9 of torchrun, ~60 s).

    .venv/bin/pytest -q tests/test_runguard.py
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import config as C
from sqltask import dataset
from trainer import runguard
from conftest import ROOT, Bounded, build_tiny_assets, torchrun_env
from test_train import read_metrics, run_train, small_args

# -----------------------------------------------------------------------------
# unit checks


def hold_lock(out_dir):
    """Another process holding out_dir's lock, started and locked when this returns."""
    code = f"import time; from trainer import runguard; fh = runguard.lock_out_dir({str(out_dir)!r}); print('locked', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_one_run_per_out_dir_and_a_killed_holder_frees_it(tmp_path):
    holder = hold_lock(tmp_path / "run")
    with pytest.raises(runguard.RunError, match=rf"in use by another run \(pid {holder.pid} on .*-c"):
        runguard.lock_out_dir(str(tmp_path / "run"))
    holder.send_signal(signal.SIGKILL)  # a crash or a kill -9: the kernel drops the lock
    holder.wait()
    fh = runguard.lock_out_dir(str(tmp_path / "run"))
    assert f"pid {os.getpid()}" in (tmp_path / "run" / "run.lock").read_text()
    fh.close()


def test_run_main_turns_endings_into_one_line_and_a_status(capsys, monkeypatch):
    def raises(e):
        def main():
            raise e
        return main
    assert runguard.run_main(lambda: None) == 0
    assert runguard.run_main(raises(C.ConfigError("grpo.group_size must be >= 2"))) == 1
    assert capsys.readouterr().err == "config error: grpo.group_size must be >= 2\n"
    assert runguard.run_main(raises(dataset.DatasetError("a.jsonl:3: not valid JSON"))) == 1
    assert capsys.readouterr().err == "data error: a.jsonl:3: not valid JSON\n"
    assert runguard.run_main(raises(runguard.Interrupted(signal.SIGINT))) == 130
    assert capsys.readouterr().err.startswith("interrupted (SIGINT): stopped at once")
    assert runguard.run_main(raises(runguard.Stopped(signal.SIGTERM))) == 143
    with pytest.raises(ZeroDivisionError):  # our own bug: its traceback
        runguard.run_main(lambda: 1 / 0)
    # rank 1: rank 0 reports the same error; rank 1 prints only if still alive after the wait
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(runguard, "REPORT_WAIT_S", 0.01)
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    try:
        assert runguard.run_main(raises(C.ConfigError("x"))) == 1
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # torchrun's SIGTERM ends the wait
    finally:
        for s, h in zip((signal.SIGTERM, signal.SIGINT), handlers):
            signal.signal(s, h)
    assert runguard.run_main(raises(runguard.Interrupted(signal.SIGINT))) == 130
    assert capsys.readouterr().err == "config error: x\n"  # the interrupt is rank 0's to print


def test_run_main_writes_the_line_to_torchruns_error_file(tmp_path, monkeypatch):
    """Under torchrun (TORCHELASTIC_ERROR_FILE set per rank) the line run_main prints is also this
    rank's error file, whose message torchrun's failure summary shows (read and formatted here by
    torch's own ProcessFailure and ChildFailedError, as its agent does); a bug of ours writes its
    traceback, as @record does. Without torchrun nothing is written."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def raises(e):
        def main():
            raise e
        return main

    def shown(exitcode):  # what the summary prints for this rank's failure
        summary = ChildFailedError("train.py", {0: ProcessFailure(0, 1, exitcode, str(error_file))}).format_msg()
        return summary.split("traceback : ", 1)[1].rsplit("\n=====", 1)[0]
    error_file = tmp_path / "error.json"
    assert runguard.run_main(raises(C.ConfigError("x"))) == 1 and not error_file.exists()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert runguard.run_main(raises(C.ConfigError("grpo.group_size must be >= 2, got 1"))) == 1
    assert shown(1) == "config error: grpo.group_size must be >= 2, got 1"
    assert runguard.run_main(raises(runguard.Stopped(signal.SIGTERM, "stopped (SIGTERM) after step 3 of 9"))) == 143
    assert shown(143) == "stopped (SIGTERM) after step 3 of 9"
    # a Ctrl-C or SIGTERM before the step loop (set-up, the first eval): stopped at once, and said so there too
    for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        error_file.unlink(missing_ok=True)
        assert runguard.run_main(raises(runguard.Interrupted(signum))) == status
        assert shown(status) == (f"interrupted ({signal.Signals(signum).name}): stopped at once, nothing saved "
                                 "since the last checkpoint")
    with pytest.raises(ZeroDivisionError):
        runguard.run_main(lambda: 1 / 0)
    assert shown(1).startswith("Traceback") and "1 / 0" in shown(1) and "ZeroDivisionError" in shown(1)


def test_stop_signals_at_once_then_at_a_step_boundary():
    import torch
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    try:
        stop = runguard.StopSignals()
        with pytest.raises(runguard.Interrupted):  # before the loop: at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        stop.at_step_boundary()
        assert stop.requested(torch.device("cpu")) == 0
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested(torch.device("cpu")) == signal.SIGINT  # noted, the step goes on
        with pytest.raises(runguard.Interrupted):  # a second one: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        del stop  # train.main returned: the handlers it found are back
        assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers
    finally:
        for s, h in zip((signal.SIGTERM, signal.SIGINT), handlers):
            signal.signal(s, h)
        runguard._signal_seen.clear()


def test_a_rank_stops_when_its_launcher_is_killed(tmp_path, monkeypatch):
    """A launcher (here a plain python process) starts a child that watches it, the way torchrun
    starts ranks; kill -9 of the launcher sends the child SIGTERM within a poll."""
    flag = tmp_path / "got_sigterm"
    child = (f"import os, signal, sys, time\n"
             f"from trainer import runguard\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (open({str(flag)!r}, 'w').write('1'), os._exit(0)))\n"
             f"assert runguard.stop_with_launcher(poll_s=0.05)\n"
             f"print('watching', flush=True)\n"
             f"time.sleep(60)\n")
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, env={**os.environ, "TORCHELASTIC_RUN_ID": "x"},
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "watching"
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 60  # one 0.05-s poll; generous for a loaded machine
    while not flag.exists():
        assert time.time() < deadline, "the child did not get SIGTERM after its launcher died"
        time.sleep(0.05)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not runguard.stop_with_launcher()  # python train.py: its parent is a shell (nohup must work)


def test_a_stop_after_the_launcher_died_names_it_whichever_signal_came_first(tmp_path):
    """kill -9 of torchrun: each rank's watcher polls for it and sends its own SIGTERM, and the ranks
    agree on the stop at the step boundary, so rank 0 may stop on rank 1's SIGTERM before its own
    watcher has woken. The line must still say the launcher is gone, not "SIGTERM". Here the child's
    watcher sleeps an hour between polls: the launcher is dead, the watcher has not noticed, and
    the line is named now."""
    child = ("import os, signal, time\n"
             "from trainer import runguard\n"
             "assert runguard.stop_with_launcher(poll_s=3600)\n"
             "parent = os.getppid()\n"
             "print('watching', flush=True)\n"
             "while os.getppid() == parent:\n"
             "    time.sleep(0.01)\n"
             "print(runguard.launcher_gone.is_set(), flush=True)\n"
             "print(runguard.stop_line(signal.SIGTERM, 3, 9, 'runs/x/ckpt_000003'), flush=True)\n")
    launcher = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
                "time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, env={**os.environ, "TORCHELASTIC_RUN_ID": "x"},
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "watching"
    p.send_signal(signal.SIGKILL)
    p.wait()
    noticed, line = p.stdout.readline().strip(), p.stdout.readline().strip()  # EOF once the child exits
    assert noticed == "False"  # the watcher had not woken: the race this test is about
    assert line == ("stopped (the launcher is gone) after step 3 of 9: saved runs/x/ckpt_000003; "
                    "the same command resumes from it")
    # without a launcher (python train.py), or with it alive, a SIGTERM is named as such
    assert runguard.stop_line(signal.SIGTERM, 3, 9, "c") == ("stopped (SIGTERM) after step 3 of 9: saved c; the same "
                                                              "command resumes from it")


# -----------------------------------------------------------------------------
# a run (python train.py, one process)


def wait_for(pred, p, what, timeout=300):
    deadline = time.time() + timeout
    while not pred():
        assert p.poll() is None, f"run ended before {what}: " + p.communicate()[0][-3000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def train_steps(out_dir) -> list[int]:
    return [r["step"] for r in read_metrics(out_dir) if "train/reward" in r]


def test_sigint_stops_at_a_step_boundary_one_run_per_out_dir_and_no_step_logged_twice(tmp_path):
    """Before: Ctrl-C printed a KeyboardInterrupt traceback and lost every GRPO step since the
    last checkpoint; a second run into the same out_dir ran beside the first (both exit 0, each
    step logged twice); after a resume metrics.jsonl held the resumed steps twice."""
    run = tmp_path / "run"
    args = small_args(tmp_path) + ["--train.eval_every=0"]
    p = run_train(args + ["--train.steps=200"], run)
    wait_for(lambda: (run / "metrics.jsonl").exists() and len(train_steps(run)) >= 2, p, "GRPO step 2")
    second = run_train(args + ["--train.steps=200"], run)  # the same command again, while the first runs
    out2, _ = second.communicate(timeout=120)
    assert second.returncode == 1 and out2.strip().splitlines()[-1].startswith(
        f"error: train.out_dir {run} is in use by another run (pid {p.pid} on "), out2[-2000:]
    assert "Traceback" not in out2
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out[-3000:]
    stopped = train_steps(run)[-1]
    assert f"stopped (SIGINT) after step {stopped} of 200: saved {run}/ckpt_{stopped:06d}" in out, out[-2000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert (run / f"ckpt_{stopped:06d}" / "trainer.pt").exists()
    assert train_steps(run) == list(range(1, stopped + 1))  # the second run logged nothing
    # resume to 2 steps more; then lose that last checkpoint (a kill after its steps were logged, before
    # its save) and run the same command again: it resumes at `stopped` and logs those steps once more
    more = args + [f"--train.steps={stopped + 2}"]
    for _ in range(2):
        p = run_train(more, run)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and f"resumed from {run}/ckpt_{stopped:06d}" in out, out[-3000:]
        assert train_steps(run) == list(range(1, stopped + 3)), train_steps(run)
        assert [r["step"] for r in read_metrics(run) if "eval/ex" in r] == [0, stopped + 2]
        assert [r["step"] for r in read_metrics(run) if "run/done" in r] == [stopped + 2]
        shutil.rmtree(run / f"ckpt_{stopped + 2:06d}")


# -----------------------------------------------------------------------------
# torchrun: 2 ranks


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("guard")
    return d, build_tiny_assets(d)


def torchrun(args, out_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "configs/tiny.yaml", *args, f"--train.out_dir={out_dir}"]
    return Bounded(cmd, cwd=ROOT, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                   start_new_session=True)


def tiny_args(d, settings):
    return ["--" + s for s in settings] + ["--data.max_train_examples=64", "--data.max_eval_examples=8",
                                          "--grpo.prompts_per_step=4", "--grpo.group_size=2",
                                          "--grpo.dynamic_sampling=false", "--sampling.max_new_tokens=24",
                                          "--sft.steps=2", "--sft.batch_size=4", "--train.eval_every=0",
                                          "--train.sample_every=0", "--train.threads=1"]


def stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: [state, ppid, ...] ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def children(pid: int) -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and stat(int(d.name))[1:2] == [str(pid)]]


def alive(pid: int) -> bool:
    s = stat(pid)
    return bool(s) and s[0] != "Z"  # a zombie has exited (nobody reaped it yet)


def rank_frames(out: str) -> bool:
    """Whether a traceback printed by a rank is in the output (torchrun's own ChildFailedError
    summary, printed for every failed run, shows frames of torch's run.py only)."""
    return f'File "{ROOT / "train.py"}"' in out or "Connection closed by peer" in out


def root_cause(out: str) -> str:
    """The message torchrun's failure summary shows under "Root Cause" (its `traceback :` field)."""
    assert "Root Cause (first observed failure):" in out, out[-3000:]
    entry = out.split("Root Cause (first observed failure):", 1)[1]
    return entry.split("traceback : ", 1)[1].split("\n=====", 1)[0]


def test_torchrun_a_data_error_is_one_line_from_rank_0(assets, tmp_path):
    """Data errors were two ~50-line rank tracebacks; now one line, once (rank 1 says nothing),
    and torchrun's summary shows the same line as its root cause."""
    d, settings = assets
    lines = (d / "toy" / "train.jsonl").read_text().splitlines()
    bad = tmp_path / "train.jsonl"
    bad.write_text("\n".join(lines[:3] + ["{not json"] + lines[3:]) + "\n")
    p = torchrun(tiny_args(d, settings) + [f"--data.train_path={bad}", "--data.prepare_toy=false"], tmp_path / "run")
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0
    line = next(x for x in out.splitlines() if x.startswith(f"data error: {bad}:4: not valid JSON"))
    assert out.splitlines().count(line) == 1 and root_cause(out) == line, out[-3000:]
    assert not rank_frames(out), out[-3000:]
    assert not list((tmp_path / "run").glob("ckpt_*"))  # before the warm start


def test_torchrun_summary_names_our_config_error(tmp_path):
    """A bad config: our one line, and torchrun's "Root Cause" (the last thing a user reads) shows it
    through rank 0's error file instead of "To enable traceback see: <docs link>"."""
    p = torchrun(["--grpo.group_size=1"], tmp_path / "run")
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0
    line = ("config error: grpo.group_size must be >= 2, got 1 (advantages compare the samples of a prompt: "
            "one sample has advantage 0 and nothing is learned)")
    assert out.splitlines().count(line) == 1 and root_cause(out) == line, out[-3000:]
    assert "To enable traceback" not in out and not rank_frames(out), out[-3000:]
    assert not (tmp_path / "run").exists()  # nothing ran


def test_torchrun_ctrl_c_then_kill_9_of_torchrun(assets, tmp_path):
    """Ctrl-C reaches torchrun only (its ranks run in sessions of their own); torchrun passes SIGINT on:
    both ranks stop after the same step, save it, one line. kill -9 of torchrun passes nothing on: the
    ranks see their parent gone and stop the same way, instead of training on as orphans."""
    d, settings = assets
    run = tmp_path / "run"
    args = tiny_args(d, settings) + ["--data.prepare_toy=false", "--train.steps=500"]
    p = torchrun(args, run)
    wait_for(lambda: (run / "metrics.jsonl").exists() and len(train_steps(run)) >= 1, p, "GRPO step 1")
    p.send_signal(signal.SIGINT)  # what a Ctrl-C in the terminal sends torchrun
    out, _ = p.communicate(timeout=120)
    stopped = train_steps(run)[-1]
    assert out.count(f"stopped (SIGINT) after step {stopped} of 500: saved {run}/ckpt_{stopped:06d}") == 1, out[-3000:]
    assert (run / f"ckpt_{stopped:06d}" / "trainer.pt").exists() and not rank_frames(out), out[-3000:]
    # resume, then kill -9 torchrun
    p = torchrun(args, run)
    wait_for(lambda: len(train_steps(run)) >= stopped + 1, p, "a GRPO step after the resume")
    ranks = children(p.pid)
    assert len(ranks) == 2, ranks
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 120
    while any(alive(pid) for pid in ranks):
        assert time.time() < deadline, "the ranks outlived torchrun"
        time.sleep(0.2)
    out = p.stdout.read()
    last = train_steps(run)[-1]
    assert last < 500 and f"stopped (the launcher is gone) after step {last} of 500" in out, out[-3000:]
    assert (run / f"ckpt_{last:06d}" / "trainer.pt").exists()
    runguard.lock_out_dir(str(run)).close()  # free: the same command can run again
