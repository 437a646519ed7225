"""What keeps a run single, stoppable and quiet about user errors: the out_dir lock, Ctrl-C / SIGTERM
at a step boundary, ranks that stop with their launcher, and one line per user error.

    if __name__ == "__main__":
        sys.exit(runguard.run_main(main))          # a user error: one line on rank 0, exit 1
    lock = runguard.lock_out_dir(out_dir)          # rank 0, before the process group: one run per out_dir
    runguard.stop_with_launcher()                  # torchrun's ranks: SIGTERM to self when torchrun is gone
    stop = runguard.StopSignals()                  # SIGINT/SIGTERM: stop at once (set-up) ...
    stop.at_step_boundary()                        # ... or, from here, at the next step boundary
    stop.at_once()                                 # ... or at once again (between warm start and loop)
    if stop.requested(device): ...                 # collective: every rank stops at the same step

User errors (config.ConfigError, dataset.DatasetError, RunError) are the same on every rank (the
config, the files, the out_dir), so rank 0 prints the line and the other ranks print nothing:
torchrun sends them SIGTERM as soon as rank 0 exits. A rank that meets one alone (rank 0 did not
exit within REPORT_WAIT_S) prints its own. Anything else is a bug of ours: its traceback, on
every rank that has it. Under torchrun the rank that prints also writes the line to its error file
(TORCHELASTIC_ERROR_FILE, the convention torch's @record follows), so the "Root Cause" of the
summary torchrun prints last shows our line, not a link to its docs (a bug: its traceback).

torchrun starts each rank in a session of its own (setsid): a Ctrl-C reaches torchrun only, which
passes the signal on to every rank and, 30 s later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), SIGKILLs the
ranks still alive. A kill -9 of torchrun passes nothing on: without stop_with_launcher the ranks
train on as orphans, writing checkpoints into an out_dir a new run would then share.
Tests: .venv/bin/pytest tests/test_runguard.py
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import weakref
from pathlib import Path

from trainer.config_loader import ConfigError
from sqltask import dataset

REPORT_WAIT_S = 20.0  # a rank > 0 with a user error waits this long for rank 0 to report it
LOCK_NAME = "run.lock"


class RunError(Exception):
    """A user-facing stop with its own message: the out_dir is in use, rank 0 failed a check."""


USER_ERRORS = (ConfigError, dataset.DatasetError, RunError)
_PREFIX = {ConfigError: "config error", dataset.DatasetError: "data error", RunError: "error"}


class Interrupted(BaseException):
    """SIGINT/SIGTERM before the step loop (or a second one in it): stop now, nothing saved."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(Exception):
    """Raised by train.py after a stop at a step boundary, its checkpoint saved and `line` printed."""

    def __init__(self, signum: int, line: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.line = signum, line


def launch_rank() -> int:
    """This process's global rank as torchrun gave it (0 without torchrun); readable before the
    process group exists."""
    return int(os.environ.get("RANK", "0"))


def launch_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# -----------------------------------------------------------------------------
# the entry point's wrapper


_signal_seen: list[int] = []  # signals a StopSignals handler received (any mode)


def run_main(main, *args) -> int:
    """Run main(*args) and turn how it ended into an exit status: 0; 1 after a user error (one
    line on rank 0); 128 + signal after a stop (train.py printed its line) or an interrupt."""
    rank = launch_rank()
    try:
        main(*args)
        return 0
    except USER_ERRORS as e:
        prefix = next(p for cls, p in _PREFIX.items() if isinstance(e, cls))
        if rank != 0:
            _wait_for_rank0()
        print(f"{prefix}: {e}", file=sys.stderr, flush=True)
        report_to_launcher(f"{prefix}: {e}")
        return 1
    except Stopped as e:
        if e.line:
            report_to_launcher(e.line)
        return 128 + e.signum
    except Interrupted as e:
        if rank == 0:
            line = (f"interrupted ({signal.Signals(e.signum).name}): stopped at once, nothing saved since the last "
                    "checkpoint")
            print(line, file=sys.stderr, flush=True)
            report_to_launcher(line)
        return 128 + e.signum
    except Exception as e:
        if rank != 0 and _signal_seen:  # rank 0 stopped on the signal first and this rank's collective
            return 128 + _signal_seen[0]  # broke off ("Connection closed by peer"): rank 0 has said it
        report_to_launcher(f"{type(e).__name__}: {e}", traceback=True)
        raise


def report_to_launcher(line: str, traceback: bool = False):
    """Under torchrun: write `line` to this rank's error file (TORCHELASTIC_ERROR_FILE, set by torchrun),
    which its failure summary shows as the "Root Cause" (the first failed rank's file), in the form
    torch's @record writes. The summary shows its py_callstack, else its message: traceback=True
    (inside an `except`) adds the traceback, as @record does. Without torchrun: nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"timestamp": str(int(time.time()))}
    if traceback:
        import traceback as tb
        extra["py_callstack"] = tb.format_exc()
    data = {"message": {"message": line, "extraInfo": extra}}
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:  # the summary then falls back to torchrun's own text: not worth failing over
        pass


def _wait_for_rank0():
    """Rank 0 meets the same user error and prints it; torchrun stops this rank when rank 0 exits.
    Exiting first could get rank 0 killed before its line is out, so wait, killable."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(REPORT_WAIT_S)


def on_rank0(fn, rank: int):
    """Run fn() on rank 0 while the other ranks wait; a user error it raises stops every rank
    (rank 0 reports it), instead of rank 0 exiting while the others sit in a collective (gloo:
    "Connection closed by peer" on each)."""
    import torch.distributed as dist
    error = None
    if rank == 0:
        try:
            fn()
        except USER_ERRORS as e:
            error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            error = RunError(box[0])
    if error is not None:
        raise error


# -----------------------------------------------------------------------------
# one run per out_dir


def lock_out_dir(out_dir: str):
    """Hold an exclusive lock on <out_dir>/run.lock for the life of this process (the open file is
    returned: keep it). A second run into the same out_dir fails at once, naming the first; the
    kernel drops the lock when the holder exits, however it exits (a crash, kill -9): never stuck."""
    import fcntl
    path = Path(out_dir) / LOCK_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+")
    except OSError as e:
        raise RunError(f"cannot write to train.out_dir {out_dir}: {e}") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise RunError(f"train.out_dir {out_dir} is in use by another run ({holder}): wait for it to end, "
                       "stop it, or choose another --train.out_dir") from None
    fh.seek(0)
    fh.truncate()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {' '.join(sys.argv)}\n")
    fh.flush()
    return fh


# -----------------------------------------------------------------------------
# ranks that outlive their launcher


launcher_gone = threading.Event()  # set before the SIGTERM stop_with_launcher sends
_watched: list[int] = []  # the launcher's pid, once stop_with_launcher watches it


def stop_with_launcher(poll_s: float = 0.5) -> bool:
    """Under torchrun: a daemon thread sends this process SIGTERM once its parent (torchrun's
    agent) is gone, so the ranks stop like after a Ctrl-C (at the next step boundary, with a
    checkpoint) instead of training on as orphans. Polls os.getppid() (Linux's PR_SET_PDEATHSIG
    fires when the forking *thread* exits, and is Linux-only). Returns whether it watches."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # python train.py: the parent is a shell (nohup is fine)
        return False
    parent = os.getppid()
    _watched[:] = [parent]

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        launcher_gone.set()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stop_with_launcher", daemon=True).start()
    return True


def launcher_is_gone() -> bool:
    """Whether this rank's launcher is gone, asked when a stop's cause is named. The watcher's flag
    alone is not enough: it polls, and the signal this rank stops on may come first. After a kill -9
    of torchrun every rank's watcher sends its own SIGTERM, and the stop is agreed over the ranks
    (StopSignals.requested), so rank 0 can stop on rank 1's SIGTERM before its own watcher wakes. Its
    parent is gone all the same (the kernel re-parents every orphan at once): read it now."""
    if not launcher_gone.is_set() and _watched and os.getppid() != _watched[0]:
        launcher_gone.set()
    return launcher_gone.is_set()


# -----------------------------------------------------------------------------
# SIGINT / SIGTERM


class StopSignals:
    """SIGINT and SIGTERM handlers. At first (set-up) a signal stops at once: Interrupted (run_main
    prints one line on rank 0). After at_step_boundary() (the warm start's steps, then GRPO's), the
    first signal only asks to stop: requested() agrees on it over all ranks at the end of a step,
    and the loop saves and stops; a second signal stops at once. at_once() goes back to the first
    mode (set-up between the warm start and the GRPO loop)."""

    def __init__(self):
        self.graceful, self.signum = False, 0
        me = weakref.ref(self)  # the handler must not keep this object alive (see finalize below)

        def handler(signum, frame):
            if (obj := me()) is not None:
                obj._handle(signum, frame)
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        # the caller's handlers come back once this object is dropped (train.main returned): an
        # in-process caller (tests/test_configs.py) keeps a working Ctrl-C
        weakref.finalize(self, _restore_handlers, previous)

    def _handle(self, signum, frame):
        _signal_seen.append(signum)
        if self.graceful and not self.signum:
            self.signum = signum
            return
        raise Interrupted(signum)

    def at_step_boundary(self):
        self.graceful = True

    def at_once(self):
        """Back to stopping at once (the warm start is over, the GRPO loop has not begun); a signal
        noted since the last requested() stops now."""
        self.graceful = False
        if self.signum:
            raise Interrupted(self.signum)

    def requested(self, device) -> int:
        """Collective: the signal some rank received (0 if none), the same on every rank."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([self.signum], dtype=torch.long, device=device)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


def _restore_handlers(previous: dict):
    if threading.current_thread() is threading.main_thread():  # signal.signal works there only
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_line(signum: int, step: int, steps: int, checkpoint: str, what: str = "step") -> str:
    """What rank 0 prints after a stop at a step boundary (what: "warm-start step" in the warm start)."""
    why = "the launcher is gone" if launcher_is_gone() else signal.Signals(signum).name
    return f"stopped ({why}) after {what} {step} of {steps}: saved {checkpoint}; the same command resumes from it"
