"""plot.py on a synthetic metrics.jsonl shaped like train.py's (SFT steps, eval events, GRPO steps,
a resumed tail and a torn last line): the PNG is written beside it, the series are read right,
and a missing matplotlib gives the install hint. ~3 s.

    .venv/bin/pytest tests/test_plot.py -q
"""
import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT

import plot


def write_metrics(path, steps=30):
    lines = [{"step": i, "sft/loss": 5 * math.exp(-i / 5), "sft/grad_norm": 1.0} for i in range(1, 11)]
    lines += [{"step": s, "eval/ex": s / 100, "eval/format_err": 0.5, "eval/turns": 2.0, "eval/tool_calls": 1.0}
              for s in range(0, steps + 1, 10)]
    for s in range(1, steps + 1):
        lines.append({"step": s, "train/reward": -1 + s / steps, "train/ex": s / steps / 2,
                      "train/format_err": 1 - s / steps, "train/turns": 3 - s / steps, "train/tool_calls": 1.5,
                      "time/rollout": 10.0, "time/reward": 1.0, "time/update": 4.0, "train/grad_norm": 0.5,
                      "train/clip_frac": 0.01})
    lines.append({"step": steps, "train/reward": 0.75})  # a resumed run logged the last step again
    with open(path, "w") as fh:
        fh.writelines(json.dumps(x) + "\n" for x in lines)
        fh.write('{"step": 31, "train/rew')  # killed mid-write


def test_read_metrics(tmp_path):
    p = tmp_path / "metrics.jsonl"
    write_metrics(p)
    s = plot.read_metrics(str(p))
    assert plot.xy(s, "eval/ex") == ([0, 10, 20, 30], [0.0, 0.1, 0.2, 0.3])
    assert plot.xy(s, "sft/loss")[0] == list(range(1, 11))
    assert s["train/reward"][30] == 0.75  # the later line wins
    assert sorted(s["time/update"]) == list(range(1, 31))


def test_running_mean():
    ys = [1.0, 2.0, 3.0, 4.0, 5.0]
    ref = [sum(ys[max(0, i - 1):i + 1]) / len(ys[max(0, i - 1):i + 1]) for i in range(len(ys))]
    assert plot.running_mean(ys, 2) == pytest.approx(ref)
    assert plot.running_mean(ys, 1) == ys


def test_png_beside_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread
    write_metrics(tmp_path / "metrics.jsonl")
    p = subprocess.run([sys.executable, str(ROOT / "plot.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "metrics.png"
    assert p.stdout.strip() == str(out) and "unreadable line" in p.stderr
    img = imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 1000
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_recovery_rate_beside_held_out_ex():
    """The EX panel draws the held-out recovery rate (eval/recovery_rate) with held-out EX, its
    first and last values in the legend; a run that never logged it draws the panel without it."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = {"eval/ex": {0: 0.45, 8: 0.55, 16: 0.6}, "eval/recovery_rate": {0: 0.27, 8: 0.5, 16: 0.71}}
    fig, (ax, bare) = plt.subplots(1, 2)
    plot.panel_success(ax, s, ["C0", "C1", "C2"])
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    rec = [ln for label, ln in lines.items() if label.startswith("held-out recovery")]
    assert len(rec) == 1 and "27% -> 71%" in rec[0].get_label(), list(lines)
    assert list(rec[0].get_xdata()) == [0, 8, 16] and list(rec[0].get_ydata()) == [0.27, 0.5, 0.71]
    assert list(lines["held-out EX (eval)"].get_ydata()) == [0.45, 0.55, 0.6]
    plot.panel_success(bare, {"eval/ex": s["eval/ex"]}, ["C0", "C1", "C2"])
    assert not [ln for ln in bare.get_lines() if ln.get_label().startswith("held-out recovery")]
    plt.close(fig)


def test_only_some_metrics(tmp_path):
    """An SFT-only run (no GRPO step yet) still draws; empty panels say so."""
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "sft/loss": 1.0 / i}) + "\n"
                                                    for i in range(1, 5)))
    assert plot.plot(str(tmp_path), str(tmp_path / "x.png")).endswith("x.png")
    assert (tmp_path / "x.png").stat().st_size > 10_000


def test_missing_matplotlib_message(tmp_path, monkeypatch):
    write_metrics(tmp_path / "metrics.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot.plot(str(tmp_path))
    assert not (tmp_path / "metrics.png").exists()


def test_no_metrics_file(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        plot.plot(str(tmp_path))


# -----------------------------------------------------------------------------
# live: --follow, train.plot_every


def test_finished_marker(tmp_path):
    p = tmp_path / "metrics.jsonl"
    assert not plot.finished(str(p))  # no file yet
    write_metrics(p)
    assert not plot.finished(str(p))
    with open(p, "a") as fh:
        fh.write("\n" + json.dumps({"step": 30, plot.DONE: 1.0}) + "\n")
    assert plot.finished(str(p))
    with open(p, "a") as fh:  # a resumed run appends after the old marker: not finished any more
        fh.write(json.dumps({"step": 31, "train/reward": 0.5}) + "\n")
    assert not plot.finished(str(p))


def test_follow_redraws_while_the_run_goes(tmp_path):
    """A writer thread appends steps like train.py; follow redraws on each change and returns at
    the run's final line. The writer appends a line once the previous one is drawn (not after a
    fixed sleep: a slow redraw on a loaded machine would see several lines at once), so every
    state is drawn exactly once, in order."""
    pytest.importorskip("matplotlib")
    import threading
    import time
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 0, "eval/ex": 0.1, "eval/random_ex": 0.02}) + "\n")
    drawn, stop = [], threading.Event()

    def append(line: dict, after_draws: int):
        # once the follower has drawn the state before (a follower that never draws: 60 s, then the
        # line anyway, and the drawn states below show what it missed instead of both waiting forever)
        deadline = time.monotonic() + 60
        while len(drawn) < after_draws and not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(p, "a") as fh:
            fh.write(json.dumps(line) + "\n")

    def writer():
        for s in range(1, 4):
            append({"step": s, "train/reward": s / 3, "train/ex": s / 6}, s)
        append({"step": 3, plot.DONE: 1.0}, 4)

    th = threading.Thread(target=writer)
    th.start()
    try:
        n = plot.follow(str(tmp_path), every=0.05, on_draw=lambda png: drawn.append(len(p.read_text().splitlines())))
    finally:
        stop.set()
        th.join()
    assert n == len(drawn) and drawn == [1, 2, 3, 4, 5]  # lines seen: the first state, each step, the final line
    assert (tmp_path / "metrics.png").stat().st_size > 10_000


def test_follow_stops_when_told(tmp_path):
    """until() (e.g. the training process exited without its final line) ends the loop."""
    pytest.importorskip("matplotlib")
    write_metrics(tmp_path / "metrics.jsonl")
    calls = []
    assert plot.follow(str(tmp_path), every=0.01, until=lambda: calls.append(1) or len(calls) > 2) == 1


def test_follow_cli_on_a_finished_run(tmp_path):
    pytest.importorskip("matplotlib")
    write_metrics(tmp_path / "metrics.jsonl")
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write("\n" + json.dumps({"step": 30, plot.DONE: 1.0}) + "\n")
    p = subprocess.run([sys.executable, str(ROOT / "plot.py"), str(tmp_path), "--follow", "--every", "0.1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"redrew {tmp_path / 'metrics.png'}", "stopped following after 1 redraws"]


def test_refresh_warns_once_without_matplotlib(tmp_path, monkeypatch, capsys):
    write_metrics(tmp_path / "metrics.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(plot, "_warned", False)
    assert plot.refresh(str(tmp_path)) is None and plot.refresh(str(tmp_path)) is None
    err = capsys.readouterr().err
    assert err.count("WARNING: train.plot_every") == 1 and "pip install matplotlib" in err
