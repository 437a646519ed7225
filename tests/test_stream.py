"""stream.py: the rounds a GRPO step trains on, sampled up to stream.sampling_steps_ahead steps ahead.

- k = 0 is the synchronous step: a step's metrics equal, to the digit, those of the step whose rounds
  are rollout-then-reward (rollout.sample_episodes) of the same prompts with the same seeds.
- k >= 1: no trained token is older than k steps; a token sampled after a sync carries the new
  version, and an episode in flight across a sync (or an eval, or a checkpoint) continues from the
  same ids; every chunk is trained once, in order, with dynamic sampling's refills too; a saved and
  restored stream trains what the uninterrupted one trains.
- 2 gloo ranks through train.py with k = 1 (tests/test_train.py style): both finish every step.
- LoRA, float16, grpo.mask_truncated and the rollout correction with k = 1 in one train.py run; a
  Ctrl-C saves the episodes in flight and the same command resumes them.

    .venv/bin/pytest tests/test_stream.py -q
"""
import copy
import dataclasses
import io
import json
import subprocess
import sys

import pytest
import torch

import config as C
import eval as evaluation
import grpo
import train
from conftest import ROOT, Bounded, build_tiny_assets, torchrun_env
from model import Transformer
from rollout import sample_episodes
from sqltask import dataset
from stream import PromptOrder, RolloutStream
from trainer import optim
from trainer.distributed import PeakMemory
from trainer.loss_scale import LossScaler
from trainer.policy_sampler import PolicySampler
from trainer.run_log import Log, Phases

STEPS = 4


@pytest.fixture(autouse=True)
def varied_rewards(monkeypatch):
    """A random tiny model breaks the format every time (reward -1 for all: no gradient). Each
    episode's reward is instead a fixed function of its text (-1, 0 or 1), so groups differ and
    every step moves the weights: later steps then test something."""
    import rollout
    from reward import Reward
    monkeypatch.setattr(rollout, "episode_rewards", lambda scripts, *a: [
        Reward(float(sum(map(ord, t.response)) % 3 - 1), sum(map(ord, t.response)) % 3 == 2, True) for t in scripts])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return d, ["--" + a for a in build_tiny_assets(d)]


def config(assets, **keys) -> C.Config:
    """A small run: 4 prompts x 2 samples a step, 2 turns of at most 10 tokens; at most 3 rows decode
    at once, so rows start at different steps and a chunk's episodes end at different times."""
    d, settings = assets
    cfg = C.load_config(settings + [f"--train.out_dir={d}/run", "--grpo.prompts_per_step=4", "--grpo.group_size=2",
                                    "--env.max_turns=2", "--sampling.max_new_tokens=10", "--sampling.max_decode_rows=3",
                                    "--sampling.temperature=1.0", "--env.workers=1", "--data.max_train_examples=64",
                                    "--optim.lr=0.05", "--optim.grad_clip=1.0"])
    for key, value in keys.items():
        group, name = key.split("__")
        setattr(getattr(cfg, group), name, value)
    return cfg


def make_run(cfg):
    """A one-rank run (plain model, world 1) and its stream, as train.main builds them."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    exs = dataset.load_examples(cfg.data.train_path, cfg.data.db_root, cfg.data.max_train_examples)
    torch.manual_seed(0)
    model = Transformer.from_pretrained(cfg.model.path, dtype=torch.float32)
    opt, sch = optim.make_optimizer(model, cfg.optim, cfg.optim.lr, 0, 100)
    sampler = PolicySampler(model, cfg.sampling)
    sampler.refresh(model)
    run = train.Run(model, None, sampler, opt, sch, LossScaler(cfg.optim, torch.float32), tok, cfg, Log(cfg, rank=1),
                    0, 1, torch.device("cpu"))
    return run, RolloutStream(sampler, tok, exs, cfg, 0, 1), exs


def steps(run, stream, n, first=0, each=None):
    """n GRPO steps (train.grpo_step); each(step, kept, seen, metrics) after each."""
    out = []
    for step in range(first, first + n):
        kept, seen, m = train.grpo_step(run, stream, step, Phases(PeakMemory(torch.device("cpu"))))
        out.append((kept, seen, m))
        if each:
            each(step, kept, seen, m)
    return out


def in_flight(stream):
    return {t.seq.index: t for t, _ in stream.loop.open.values()}


@pytest.fixture
def one_straggler_per_chunk(monkeypatch):
    """Every engine run the stream starts gets a logits hook: each episode but the last of its chunk
    closes its message (EOS) at its first token, the last one samples on (a straggler of 2 turns of
    10 tokens). So while a round waits for its chunk's straggler, rows free up at once and the
    window rule alone decides what starts: the staleness bound is tested at its edge."""
    from engine.engine import Engine
    reset = Engine.reset

    def with_hook(engine, stopper, *, logits_hook=None, **kw):
        if not stopper.eos:  # the sampler's own first reset (no run yet)
            return reset(engine, stopper, logits_hook=logits_hook, **kw)
        eos = min(stopper.eos)

        def hook(logits, seqs):
            for b, seq in enumerate(seqs):
                if seq.index % 8 != 7:  # 4 prompts x 2 samples a chunk: sequence 8c + 7 straggles
                    logits[b] = float("-inf")
                    logits[b, hook.eos] = 0.0
            return logits
        hook.eos = eos
        return reset(engine, stopper, logits_hook=logits_hook or hook, **kw)
    monkeypatch.setattr(Engine, "reset", with_hook)


@pytest.fixture
def turns_of_varied_length(monkeypatch):
    """Every engine run gets a logits hook that closes sequence i's message (EOS) after 1 + i % 7
    tokens: rows that joined the decode batch together leave it at different steps."""
    from engine.engine import Engine
    reset = Engine.reset

    def with_hook(engine, stopper, *, logits_hook=None, **kw):
        if not stopper.eos:  # the sampler's own first reset (no run yet)
            return reset(engine, stopper, logits_hook=logits_hook, **kw)
        eos = min(stopper.eos)

        def hook(logits, seqs):
            for b, seq in enumerate(seqs):
                if len(seq.ids) - seq.turn_start >= seq.index % 7:
                    logits[b] = float("-inf")
                    logits[b, eos] = 0.0
            return logits
        return reset(engine, stopper, logits_hook=logits_hook or hook, **kw)
    monkeypatch.setattr(Engine, "reset", with_hook)


# -----------------------------------------------------------------------------
# k = 0: the synchronous step


def test_k0_steps_equal_rollout_then_reward_rounds(assets, monkeypatch):
    """The step's metrics, to the digit, against train.collect done the synchronous way: each round
    the next chunk of the prompt order, rollout.sample_episodes with the round's seed."""
    cfg = config(assets)
    run, stream, exs = make_run(cfg)
    got = [m for _, _, m in steps(run, stream, 3)]
    stream.close()

    order = PromptOrder(len(exs), cfg.train.seed)

    def collect(run, stream, step, phase):  # the synchronous step's collect, no dynamic sampling
        prompts = [exs[i] for i in order.take(cfg.grpo.prompts_per_step)]
        seed = (cfg.train.seed * 1_000_003 + step * 1009) % (2 ** 31)
        episodes = sample_episodes(run.sampler, run.tokenizer, prompts, cfg, n=cfg.grpo.group_size, seed=seed,
                                   phase=phase)
        return episodes, episodes
    run, stream, _ = make_run(cfg)
    monkeypatch.setattr(train, "collect", collect)
    want = [m for _, _, m in steps(run, stream, 3)]
    stream.close()
    # the stream's own metrics: the reference path neither counts the engine's steps nor sets its version
    own = ("live_row_frac", "decode_steps_per_episode", "staleness_mean", "staleness_max", "stale_token_frac")
    for g, w in zip(got, want):
        assert g.get("grad_norm", 0) > 0  # the weights moved: later steps compare something
        assert {k: v for k, v in g.items() if k not in own} == {k: v for k, v in w.items() if k not in own}
        assert (g["staleness_max"], g["stale_token_frac"]) == (0.0, 0.0) and 0 < g["live_row_frac"] <= 1


# -----------------------------------------------------------------------------
# k >= 1: staleness, versions, episodes across a sync


@pytest.mark.parametrize("ahead", [1, 2])
def test_no_trained_token_is_older_than_k_steps(assets, ahead, one_straggler_per_chunk):
    cfg = config(assets, stream__sampling_steps_ahead=ahead, sampling__max_decode_rows=0)
    run, stream, _ = make_run(cfg)
    ages = []

    def check(step, kept, seen, m):
        for e in kept:
            t = e.trajectory
            versions = [v for v, mask in zip(t.versions, t.loss_mask) if mask]
            assert versions and all(step - ahead <= v <= step for v in versions), (step, versions)
            ages.extend(step - v for v in versions)
        assert m["staleness_max"] <= ahead
    steps(run, stream, 6, each=check)
    stream.close()
    assert max(ages) >= 1  # the stream did sample ahead: the bound was tested, not idle


def test_tokens_after_a_sync_carry_the_new_version_and_continue_the_same_ids(assets):
    """Episodes in flight at a step's end keep their ids through the update and the weight sync
    (in place, KV kept); what they sample next is tagged with the next step's version."""
    cfg = config(assets, stream__sampling_steps_ahead=1)
    run, stream, _ = make_run(cfg)
    crossed = 0
    for step in range(4):
        before = {i: (list(t.ids), list(t.versions)) for i, t in in_flight(stream).items()}
        _, seen, _ = steps(run, stream, 1, first=step)[0]
        for t in [e.trajectory for e in seen] + [t for c in stream.chunks for t in c.trajs]:
            if t.seq.index in before:
                ids, versions = before[t.seq.index]
                assert t.ids[:len(ids)] == ids and t.versions[:len(ids)] == versions  # the same episode, continued
                new = [v for v, m in zip(t.versions[len(ids):], t.loss_mask[len(ids):]) if m]
                assert all(v == step for v in new), (step, new)
                crossed += bool(new) and any(v == step - 1 for v, m in zip(versions, t.loss_mask) if m)
    stream.close()
    assert crossed  # some episode sampled on both sides of a sync


def test_recompute_kv_continues_the_same_ids(assets):
    cfg = config(assets, stream__sampling_steps_ahead=1, stream__recompute_kv=True)
    run, stream, _ = make_run(cfg)
    steps(run, stream, 2)
    before = {i: list(t.ids) for i, t in in_flight(stream).items()}
    resets = run.sampler.engine.resets
    _, seen, _ = steps(run, stream, 1, first=2)[0]
    assert run.sampler.engine.resets == resets + 1  # the new weights recomputed the rows' KV
    continued = [t for t in [e.trajectory for e in seen] + [t for c in stream.chunks for t in c.trajs]
                 if t.seq.index in before]
    assert before and all(t.ids[:len(before[t.seq.index])] == before[t.seq.index] for t in continued)
    stream.close()


def test_open_episodes_never_exceed_one_rank_share(assets):
    """The stream starts the next group only when a whole group's rows are free: the open episodes
    never exceed one rank share's episodes (the synchronous step's peak batch, which sizes the KV)."""
    cfg = config(assets, stream__sampling_steps_ahead=2, grpo__group_size=3)
    run, stream, _ = make_run(cfg)
    add, most = stream.loop.add, []

    def add_and_count(trajs, dbs):
        ended = add(trajs, dbs)
        most.append(len(stream.loop.open) + len(ended))  # open right after the add, before any ended at once
        return ended
    stream.loop.add = add_and_count
    steps(run, stream, 3)
    stream.close()
    assert max(most) == stream.share_episodes, (most, stream.share_episodes)  # never above the cap, and reached
    assert len(most) > 4  # groups also started mid-round, as rows freed up


def test_a_chunk_decoded_ahead_equals_the_same_chunk_decoded_synchronously(assets):
    """On fixed weights (no update between rounds) a chunk decoded ahead, k = 1 (most of its episodes
    started during the round before it), samples what the synchronous stream samples for it: each
    chunk's keys come from its index, not from the round that happens to start it."""
    def chunks(ahead):
        run, stream, _ = make_run(config(assets, stream__sampling_steps_ahead=ahead))
        out = [[(e.trajectory.seq.key, list(e.trajectory.ids)) for e in stream.next_round(step)] for step in range(3)]
        stream.close()
        return out
    sync, ahead = chunks(0), chunks(1)
    assert [[key for key, _ in c] for c in ahead] == [[key for key, _ in c] for c in sync]
    assert ahead == sync
    keys = [key for c in sync for key, _ in c]
    assert len(set(keys)) == len(keys)  # no two episodes of any chunks share a key


@pytest.mark.parametrize("recompute", [False, True])
def test_a_round_recomputes_the_kv_in_flight_only_under_recompute_kv(assets, monkeypatch, recompute):
    """With stream.recompute_kv false and nothing else using the engine, no round recomputes the KV
    of the episodes in flight (the stream records its own engine reset); with it true, each new
    step's first round recomputes them. Counted: the tokens readmitted (recomputed from their ids)."""
    from engine.engine import Engine
    cfg = config(assets, stream__sampling_steps_ahead=1, stream__recompute_kv=recompute)
    readmit, recomputed = Engine.readmit, []

    def counting(engine, seqs):
        recomputed.append(sum(len(s.ids) for s in seqs))
        return readmit(engine, seqs)
    monkeypatch.setattr(Engine, "readmit", counting)
    run, stream, _ = make_run(cfg)
    in_flight_at_steps = []
    steps(run, stream, 3, each=lambda *a: in_flight_at_steps.append(len(stream.loop.open)))
    stream.close()
    assert any(in_flight_at_steps[:-1])  # episodes were in flight across a step boundary
    if recompute:
        assert sum(recomputed) > 0
    else:
        assert sum(recomputed) == 0, recomputed


def test_decode_steps_are_counted_per_step(assets):
    """k = 0, one round per step on a reset engine: a step's decode_steps_per_episode and live_row_frac
    are that round's, as the engine's own counters give them (not a sum since the run's start)."""
    cfg = config(assets)
    run, stream, _ = make_run(cfg)
    seen_steps = []

    def check(step, kept, seen, m):
        stats = run.sampler.engine.stats  # reset by this step's round
        assert m["decode_steps_per_episode"] * len(seen) == stats["decode_steps"], (step, m, stats)
        assert m["live_row_frac"] == stats["live_rows"] / (stats["decode_steps"] * stream.share_episodes)
        seen_steps.append(stats["decode_steps"])
    steps(run, stream, 3, each=check)
    stream.close()
    assert all(seen_steps)


def test_rows_stay_in_joining_order_except_on_the_stream(assets, monkeypatch, turns_of_varied_length):
    """The engine moves a leaving row's place to the last row (rows_in_place) only for a streaming
    stream (k >= 1), whose batch changes every step; the synchronous step (k = 0) and every
    rollout() (the evals) keep the rows in the order they joined, so their batched floats are the
    joining order's. Seen from the decode batches the runner gets, against the scheduler's joins."""
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    joins, batches, clock = {}, [], iter(range(10 ** 9))
    started, decode = Scheduler.started, ModelRunner.decode

    def join(sched, seqs):
        for s in seqs:
            joins[id(s)] = next(clock)
        return started(sched, seqs)

    def record(runner, seqs, n):
        batches.append([joins[id(s)] for s in seqs])
        return decode(runner, seqs, n)
    monkeypatch.setattr(Scheduler, "started", join)
    monkeypatch.setattr(ModelRunner, "decode", record)

    def in_joining_order():
        out = all(b == sorted(b) for b in batches)
        batches.clear()
        return out
    wide = dict(sampling__max_decode_rows=0)  # a batch of 4+ rows: a leaving row's place can go to another
    run, stream, exs = make_run(config(assets, **wide))
    steps(run, stream, 2)
    stream.close()
    assert in_joining_order()
    run, stream, exs = make_run(config(assets, stream__sampling_steps_ahead=1, **wide))
    steps(run, stream, 2)
    assert not in_joining_order()  # rows moved in place
    sample_episodes(run.sampler, run.tokenizer, exs[:4], config(assets, **wide), n=2, seed=1)  # an eval's path
    stream.close()
    assert in_joining_order()


def test_an_eval_pauses_the_stream_and_it_resumes_on_the_same_ids(assets):
    cfg = config(assets, stream__sampling_steps_ahead=1)
    run, stream, exs = make_run(cfg)
    steps(run, stream, 2)
    before = {i: list(t.ids) for i, t in in_flight(stream).items()}
    assert before
    class Lines(list):  # what the eval logs and prints (a nested prefix, as the warm start's checks use)
        def print(self, line):
            self.append(line)

        def metrics(self, step, metrics):
            self.append(metrics)
    log = Lines()
    metrics = evaluation.evaluate(run.sampler, run.tokenizer, exs[:3], cfg, 0, 1, torch.device("cpu"), log, 2,
                                  prefix="sft/train")
    assert 0 <= metrics["sft/train/ex"] <= 1 and log[0] is metrics and log[1].startswith("[sft/train @ step 2] EX ")
    kept, seen, _ = steps(run, stream, 1, first=2)[0]
    assert all(e.trajectory.end_reason for e in seen)
    continued = [t for t in [e.trajectory for e in seen] + [t for c in stream.chunks for t in c.trajs]
                 if t.seq.index in before]
    assert continued and all(t.ids[:len(before[t.seq.index])] == before[t.seq.index] for t in continued)
    stream.close()


# -----------------------------------------------------------------------------
# every chunk once, in order; dynamic sampling's refills; a saved and restored stream


def test_refill_rounds_train_every_chunk_once_in_order_and_tag_tokens_with_the_step(assets, monkeypatch):
    """Dynamic sampling keeps only groups whose first prompt index is even (a stand-in for groups
    with a spread of rewards): steps take refill rounds from the stream, each chunk once, in order.
    Every sampled token carries the step whose weights sampled it (never the index of a chunk,
    which refills push ahead of the step): no age is negative, none above k."""
    cfg = config(assets, stream__sampling_steps_ahead=1, grpo__dynamic_sampling=True, grpo__max_resample_rounds=3)
    run, stream, exs = make_run(cfg)
    ids = {ex["id"]: i for i, ex in enumerate(exs)}
    monkeypatch.setattr(grpo, "keep_mask", lambda batch, G, metric: [ids[e.example["id"]] % 2 == 0 for e in batch])
    order, rounds, seen_all = PromptOrder(len(exs), cfg.train.seed), [], []

    def check(step, kept, seen, m):
        seen_all.extend(seen)
        versions = [v for e in seen for v, mask in zip(e.trajectory.versions, e.trajectory.loss_mask) if mask]
        assert versions and all(step - 1 <= v <= step for v in versions), (step, sorted(set(versions)))
        assert 0 <= m["staleness_mean"] <= m["staleness_max"] <= 1
        assert all(ids[e.example["id"]] % 2 == 0 for e in kept)
        assert len(kept) <= cfg.grpo.prompts_per_step * cfg.grpo.group_size
        rounds.append(len(seen) // (cfg.grpo.prompts_per_step * cfg.grpo.group_size))
    steps(run, stream, 4, each=check)
    stream.close()
    assert max(rounds) > 1  # refills happened
    chunks = [order.take(cfg.grpo.prompts_per_step) for _ in range(sum(rounds))]
    assert [ids[e.example["id"]] for e in seen_all[::cfg.grpo.group_size]] == [i for c in chunks for i in c]


def test_a_restored_stream_trains_what_the_uninterrupted_one_trains(assets):
    """Saved after step 2 (plain data, through torch.save/load with weights_only) and restored into a
    new stream on the same weights: the episodes in flight come back with their ids, logprobs and
    versions, and the tool calls in flight run again, due at the same loop clock; the next steps
    train what the uninterrupted run trains, every episode once, token for token (with
    stream.recompute_kv both recompute the KV in flight at the same round, so the floats agree too).
    The save is taken a few loop iterations into the next round's work, once a tool batch is in
    flight (due 6 engine steps after its turns ended)."""
    cfg = config(assets, stream__sampling_steps_ahead=1, env__tool_overlap_steps=6, stream__recompute_kv=True)
    run, stream, _ = make_run(cfg)
    steps(run, stream, 2)
    for _ in range(200):  # the loop goes on as the next round would, until a tool batch is in flight
        if stream.loop.tools.pending:
            break
        stream._advance()
    assert stream.state_dict()["tools"]  # tool calls in flight at the save
    buf = io.BytesIO()
    torch.save({"stream": [stream.state_dict()]}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["stream"]
    saved = {t.seq.index: (list(t.ids), list(t.logprobs), list(t.versions)) for c in stream.chunks for t in c.trajs}
    snapshot = [copy.deepcopy(x.state_dict()) for x in (run.model, run.optimizer, run.scheduler)]
    assert any(len(ids) > len(t.prompt_ids) for c in stream.chunks for t in c.trajs for ids, _, _ in
               [saved[t.seq.index]])  # some episode was in flight with sampled tokens
    pending = [i for _, indices in state[0]["tools"] for i in indices]
    rejoined = rejoin_clocks(stream)
    straight = trained(steps(run, stream, 2, first=2))
    stream.close()

    for x, state_of in zip((run.model, run.optimizer, run.scheduler), snapshot):  # back to the save's weights
        x.load_state_dict(state_of)
    run.sampler.refresh(run.model)
    restored = RolloutStream(run.sampler, run.tokenizer, stream.examples, cfg, 0, 1)
    restored.load_state_dict(state, state[0]["cursor"])
    for c in restored.chunks:
        for t in c.trajs:
            assert (t.ids, t.logprobs, t.versions) == saved[t.seq.index]
    rejoined_again = rejoin_clocks(restored)
    again = trained(steps(run, restored, 2, first=2))
    restored.close()
    assert [[x[0] for x in s] for s in again] == [[x[0] for x in s] for s in straight]  # none lost, none twice
    # the tool calls in flight at the save come back at the loop clock they were due at, as in the
    # uninterrupted run (their rows rejoin the batch at the same engine step), and the resume is exact
    assert [rejoined_again[i][0] for i in pending] == [rejoined[i][0] for i in pending]
    assert again == straight


def trained(results) -> list[list[tuple]]:
    """Per step, each sampled episode's (example id, ids, logprobs, versions)."""
    return [[(e.example["id"], list(e.trajectory.ids), list(e.trajectory.logprobs), list(e.trajectory.versions))
             for e in seen] for _, seen, _ in results]


def rejoin_clocks(stream) -> dict:
    """{sequence index: the loop clocks at which its tool results came back}, filled as the stream runs."""
    out, collect = {}, stream.loop.tools.collect

    def recording(clock, idle):
        got = collect(clock, idle)
        for t, _ in got:
            out.setdefault(t.seq.index, []).append(clock)
        return got
    stream.loop.tools.collect = recording
    return out


def test_a_checkpoint_with_episodes_in_flight_resumes_on_as_many_ranks(assets):
    cfg = config(assets, stream__sampling_steps_ahead=1)
    run, stream, _ = make_run(cfg)
    steps(run, stream, 1)
    state = [stream.state_dict()]
    other = RolloutStream(run.sampler, run.tokenizer, stream.examples, dataclasses.replace(cfg), 0, 2)
    with pytest.raises(C.ConfigError, match="resume it on 1 ranks"):
        other.load_state_dict(state * 1, state[0]["cursor"])
    stream.close()
    other.close()


# -----------------------------------------------------------------------------
# train.py on 2 gloo ranks with k = 1


def test_two_ranks_stream_through_train_py(assets, tmp_path):
    """Both ranks take every step (each joins every collective, whatever its share of complete
    groups): a rank that skipped one fails its peer's next collective within 60 s, not a hang."""
    d, settings = assets
    args = [a.removeprefix("--") for a in settings]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "configs/tiny.yaml", *[f"--{a}" for a in args], f"--train.out_dir={tmp_path}/run", "--train.steps=4",
           "--sft.steps=0", "--grpo.prompts_per_step=4", "--grpo.group_size=2", "--grpo.dynamic_sampling=false",
           "--sampling.max_new_tokens=10", "--sampling.max_decode_rows=3", "--env.max_turns=2",
           "--data.max_train_examples=64", "--data.max_eval_examples=4", "--train.eval_every=2",
           "--train.sample_every=0", "--train.threads=1", "--stream.sampling_steps_ahead=1",
           "--train.dist_timeout_s=60"]
    p = Bounded(cmd, cwd=ROOT, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    trained = [x for x in lines if "train/staleness_max" in x]
    assert [x["step"] for x in trained] == [1, 2, 3, 4]
    assert all(x["train/staleness_max"] <= 1 for x in trained) and any(x["train/staleness_mean"] > 0 for x in trained)


def test_two_ranks_log_the_staleness_of_every_rank():
    """step_metrics on 2 gloo ranks (tests/stream_dist_check.py): rank 1 holds the oldest token (3
    steps); both ranks log its age as the maximum, and the mean and stale share over all 8 tokens."""
    from conftest import run_dist_check
    out = run_dist_check("stream_dist_check.py", timeout=120)
    assert out.returncode == 0, out.why()
    assert sorted(out.lines()) == [f"RESULT rank={r} max=3 mean=0.5 stale=0.25" for r in (0, 1)], out.why()


def test_lora_float16_mask_truncated_and_a_ctrl_c_save_under_streaming(assets, tmp_path):
    """The rest of the trainer with k = 1 in one train.py run: LoRA adapters, float16 with its loss
    scale, grpo.mask_truncated (turns of 32 tokens: some episodes are cut, and masked), the rollout
    correction. A Ctrl-C after step 2 saves the episodes in flight with the checkpoint; the same
    command then resumes them and logs every step once."""
    import signal
    import time
    d, settings = assets
    run = tmp_path / "run"
    # a short warm start: some episodes close their tags (trained, sampled ahead), others are cut (masked)
    args = [*[f"--{a.removeprefix('--')}" for a in settings], "--sft.steps=60", "--sft.lr=1e-2",
            "--sft.stop_at_train_ex=0", "--sft.eval_every=0", "--grpo.prompts_per_step=4",
            "--grpo.group_size=4", "--grpo.dynamic_sampling=false", "--sampling.max_new_tokens=32",
            "--sampling.max_decode_rows=3", "--env.max_turns=2", "--data.max_train_examples=64",
            "--data.max_eval_examples=4", "--train.eval_every=0", "--train.sample_every=0", "--train.threads=1",
            "--stream.sampling_steps_ahead=1", "--model.lora_rank=4", "--model.dtype=float16",
            "--grpo.mask_truncated=true", "--grpo.rollout_is=token-tis", f"--train.out_dir={run}"]
    env = torchrun_env() | {"OMP_NUM_THREADS": "1"}

    def start(steps):
        return Bounded([sys.executable, "train.py", "configs/tiny.yaml", *args, f"--train.steps={steps}"], cwd=ROOT,
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def trained():
        path = run / "metrics.jsonl"
        return [r for r in map(json.loads, open(path)) if "train/reward" in r] if path.exists() else []
    p = start(200)
    deadline = time.time() + 240
    while len(trained()) < 2:
        assert p.poll() is None, p.communicate()[0][-3000:]
        assert time.time() < deadline, "no GRPO step 2 within 240 s"
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    stopped = trained()[-1]["step"]
    assert p.returncode == 130 and f"stopped (SIGINT) after step {stopped} of 200" in out, out[-3000:]
    extra = torch.load(run / f"ckpt_{stopped:06d}" / "trainer.pt", weights_only=True)["extra"]
    started = [e for c in extra["stream"][0]["chunks"] for e in c["episodes"] if e["seq"]["status"] != "new"]
    assert started, "the Ctrl-C checkpoint holds no episode of the next step's chunk"
    assert (run / f"ckpt_{stopped:06d}" / "adapter").exists()
    p = start(stopped + 2)
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0 and f"resumed from {run}/ckpt_{stopped:06d}" in out, out[-3000:]
    lines = trained()
    assert [r["step"] for r in lines] == list(range(1, stopped + 3))  # none lost, none logged twice
    assert all(r["train/staleness_max"] <= 1 for r in lines) and any(r["train/stale_token_frac"] > 0 for r in lines)
    assert any(r["train/grad_norm"] > 0 for r in lines)  # rewards differ within groups: the adapters move
    assert all(r["train/loss_scale"] > 0 for r in lines)  # the float16 loss scale ran every step
    assert any(r["train/masked_frac"] > 0 for r in lines)  # truncated episodes left out of the loss
    assert any("train/is_weight_mean" in r for r in lines)
