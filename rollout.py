"""Multi-turn text-to-SQL episodes on the sampler's engine: render, sample, parse, run the tool,
observe; then reward them, one typed Episode each (what a GRPO step carries to the update).

    episodes = sample_episodes(sampler, tok, examples, cfg, n=G, seed=s)   # rollout then reward: Episode list
    trajs = rollout(model, tok, examples, env_cfg, sampling_cfg, data_cfg, db_root, n=5, seed=s)  # the loop
    trajs = replay(turns, db_paths, env_cfg, budget=3, tokenizer=tok, prompt_ids=p)  # scripted turns
    trajs = generate(model, prompt_ids, sampling_cfg, ["</sql>"], tokenizer, seed=0)  # one turn

An episode: the prompt (chat template) is sampled until a stop string, EOS or the turn's budget;
the env parses the turn and runs its SQL; the observation's tokens are appended (loss mask 0) and
the next turn samples after them; `_end_reason` alone decides when an episode ends, and
END_REASONS names why (Trajectory.end_reason; TRUNCATED: those that ran out of room). Token in,
token out: ids are never re-tokenized, the loss mask is 1 exactly on sampled tokens, logprobs are
the sampler's (log softmax of logits / temperature). The engine (engine/engine.py: paged KV cache,
continuous batching) keeps every row's cache between turns. All episodes start in one engine.add,
so the n samples of an example are prefilled once and share the prompt's KV blocks (an
observation extends only its own row; the shared, partly filled last block is copied on first
write). Rows that ended a turn wait for their tool calls in background threads while the others
keep decoding (ToolCalls; env.tool_wait: fixed = collected a fixed number of engine steps later,
async = as soon as they arrive). Randomness is counter-based per (seed, trajectory, position)
(engine/sampling.py): batching, sharing, evictions and timing never change a sample.

Tests: .venv/bin/pytest tests/test_rollout.py tests/test_engine.py tests/test_rollout_share.py
Benchmarks: bench/sampler.py, bench/multiturn.py, bench/rollout_scale.py
"""
from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import env
from engine.engine import Engine
from engine.sampling import StopChecker, row_key
from engine.scheduler import Sequence
from reward import Reward, Transcript, episode_rewards
from sqltask import dataset
from sqltask.chat import conversation_pieces, eos_ids, observation_ids, render_prompt


# Why an episode ended: Trajectory.end_reason, one of these (the step's train/end_<reason> and the
# eval's eval/end_<reason> are the fraction of episodes per reason). A new way to end needs a name here.
END_REASONS = {
    "answer": "the env read a final answer (a closed <solution>, or ANSWER)",
    "turn_budget": "the last turn the budget allows (env.max_turns / env.step_budget) ended at its stop "
                   "tag, or at an EOS the env stepped, without an answer",
    "turn_cut": "the last turn the budget allows was cut at sampling.max_new_tokens before its stop tag",
    "context": "no room left in sampling.max_context: a turn cut by it, or an observation that leaves no "
               "room for another turn",
    "eos": "the model closed its only message (EOS, single-message conversation) without an answer",
}
# Ran out of room (grpo.mask_truncated leaves these out of the loss): a hard cut in mid-turn, at a
# length the policy is not shown (DAPO's truncation: the generation length ran out). turn_budget is
# not one: each observation tells the policy how many turns are left, and spending them without an
# answer is a policy failure that its format-failure reward should keep teaching against.
TRUNCATED = ("context", "turn_cut")


def end_reason_of(stop_reason: str, last_turn_stop: str) -> str:
    """The END_REASONS name of an episode's end from its stop_reason (what _end_reason returned:
    solution | max_turns | max_context | eos) and why its last turn stopped (engine Sequence.
    stop_reason: stop | eos | length | max_context). An unknown stop_reason passes through."""
    if stop_reason == "max_turns":
        return "turn_cut" if last_turn_stop == "length" else "turn_budget"
    return {"solution": "answer", "max_context": "context", "eos": "eos"}.get(stop_reason, stop_reason)


@dataclass
class Trajectory:
    """One episode. Its token state is its engine Sequence (`seq`, the one object the engine and
    this episode share): ids, loss_mask and logprobs read it. The other fields are the episode's."""
    prompt_ids: list[int]
    seq: Sequence = field(repr=False)  # ids, loss_mask, logprobs, turn_start, ... (engine/scheduler.py)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each turn in ids
    num_turns: int = 0
    num_tool_calls: int = 0
    final_sql: str = ""
    stop_reason: str = ""  # solution|max_turns|max_context|eos (generate: stop|eos|length|max_context)
    end_reason: str = ""  # why the episode ended: a key of END_REASONS (rollout, replay; generate leaves "")
    finished: bool = False  # wrote a final answer (solution)
    text: str = ""  # everything after the prompt, decoded once at the end
    steps: list[dict] = field(default_factory=list)  # per env step: env.step_record (kind, arg, ok, rows)
    index: int = 0  # example index (rollout) or prompt index (generate)
    sample: int = 0  # sample index within the example's group

    @property
    def truncated(self) -> bool:  # it ran out of room (TRUNCATED), not out of turns or answered
        return self.end_reason in TRUNCATED

    @property
    def generated_tokens(self) -> int:  # the model's own tokens (loss mask 1), every turn; no observation
        return int(sum(self.loss_mask))

    @property
    def ids(self) -> list[int]:  # prompt + all turns (sampled, observation and template tokens)
        return self.seq.ids

    @property
    def loss_mask(self) -> list[int]:  # aligned to ids: 1 exactly on sampled tokens (incl. stop string, EOS)
        return self.seq.loss_mask

    @property
    def logprobs(self) -> list[float]:  # aligned to ids: log softmax(logits/T) of sampled tokens, 0 elsewhere
        return self.seq.logprobs

    @classmethod
    def start(cls, prompt: list[int], key: int, index: int, sample: int, position: int) -> "Trajectory":
        return cls(list(prompt), Sequence(list(prompt), key=key, index=position), index=index, sample=sample)

    @classmethod
    def of(cls, prompt_ids: list[int], ids: list[int], loss_mask: list[int], logprobs: list[float],
           **episode) -> "Trajectory":
        """A finished episode from its token lists (tests, benchmarks)."""
        return cls(list(prompt_ids), Sequence(ids, key=0, loss_mask=loss_mask, logprobs=logprobs), **episode)

    def done(self) -> None:
        """The engine is through with it: drop what only the engine needed (blocks, followers)."""
        self.seq.block_table, self.seq.followers = [], []

    def turn_texts(self, tokenizer) -> list[dict]:
        """Each turn's model text and the observation appended after it ("" after the last),
        decoded from the ids: what the model saw, template tokens included in the conversation format."""
        out = []
        for k, (start, end) in enumerate(self.turn_spans):
            nxt = self.turn_spans[k + 1][0] if k + 1 < len(self.turn_spans) else len(self.ids)
            out.append({"text": tokenizer.decode(self.ids[start:end]), "observation": tokenizer.decode(self.ids[end:nxt])})
        return out

    def token_turns(self) -> list[int]:
        """The turn (0 = the first) of each loss token: positions j >= 1 with loss_mask[j] = 1, in
        order (what packing scores). Every sampled token lies in its turn's span."""
        out, k = [], 0
        for j in range(1, len(self.ids)):
            if self.loss_mask[j]:
                while k + 1 < len(self.turn_spans) and j >= self.turn_spans[k + 1][0]:
                    k += 1
                out.append(k)
        return out


# -----------------------------------------------------------------------------
# single turn


def generate(model, prompts: list[list[int]], cfg, stop_strings, tokenizer, *, seed: int, greedy: bool = False,
             eos: list[int] | None = None, dtype=None, logits_hook=None) -> list[Trajectory]:
    """Single-turn batched sampling. prompts: token ids; cfg: config.SamplingConfig.
    eos: ids that end a row (default eos_ids(tokenizer); [] ignores EOS). Returns one Trajectory
    per prompt (num_turns 1, stop_reason stop|eos|length|max_context)."""
    eos = eos_ids(tokenizer) if eos is None else eos
    stopper = StopChecker(tokenizer, stop_strings, eos, model.config.vocab_size)
    trajs = [Trajectory.start(p, row_key(seed, i), i, 0, i) for i, p in enumerate(prompts)]
    worst = [min(cfg.max_context, len(p) + cfg.max_new_tokens) for p in prompts]
    with Engine(model, cfg, stopper, worst_case=worst, greedy=greedy, dtype=dtype, logits_hook=logits_hook) as engine:
        engine.add([t.seq for t in trajs if len(t.ids) < cfg.max_context])
        while engine.busy():
            for seq in engine.step():
                engine.finish(seq)
    for t in trajs:
        t.num_turns, t.stop_reason = t.seq.num_turns, t.seq.stop_reason or "max_context"
        t.turn_spans = [(t.seq.turn_start, len(t.ids))] if t.num_turns else []
        t.text = tokenizer.decode(t.ids[len(t.prompt_ids):]) if tokenizer is not None else ""
        t.done()
    return trajs


# -----------------------------------------------------------------------------
# multi-turn episodes


def max_turns(env_cfg) -> int:
    """Generations an episode may have: max_turns (tags protocol) or step_budget (actions)."""
    return env_cfg.step_budget if env_cfg.protocol == "actions" else env_cfg.max_turns


def rollout(model, tokenizer, examples, env_cfg, sampling_cfg, data_cfg, db_root, *, n: int = 1, seed: int = 0,
            greedy: bool = False, dtype=None, logits_hook=None, stats: dict | None = None,
            engine: Engine | None = None) -> list[Trajectory]:
    """Multi-turn episodes, n samples per example (example-major: index i*n + j is sample j of
    example i). Each example needs db_path (absolute or relative to db_root) + what
    prompts.build_messages reads (question, evidence, ...). dtype: the KV cache's (the compute
    dtype; default the parameters'). stats: a dict to fill with engine_counters (prefilled
    tokens, peak blocks, ...). engine: a persistent Engine on `model` (trainer/policy_sampler.py) reset and
    reused, its pool, buffers and graphs kept; default a new one for this rollout, freed after.
    Returns P*n Trajectories."""
    prompt_ids = [render_prompt(tokenizer, ex, data_cfg, env_cfg.protocol, db_root) for ex in examples]
    dbs = [dataset.abs_db_path(ex, db_root) for ex in examples]
    trajs = [Trajectory.start(p, row_key(seed, i * n + j), i, j, i * n + j) for i, p in enumerate(prompt_ids)
             for j in range(n)]
    stopper = StopChecker(tokenizer, env.STOP_STRINGS[env_cfg.protocol], eos_ids(tokenizer), model.config.vocab_size)
    worst = [_worst_case(t, env_cfg, sampling_cfg) for t in trajs]
    if engine is None:
        run = Engine(model, sampling_cfg, stopper, worst_case=worst, greedy=greedy, dtype=dtype, logits_hook=logits_hook)
    else:
        if engine.model is not model:
            raise ValueError("rollout: a persistent engine samples its own model: pass engine.model")
        engine.reset(stopper, worst_case=worst, greedy=greedy, logits_hook=logits_hook, cfg=sampling_cfg)
        run = contextlib.nullcontext(engine)
    with run as engine, ToolCalls(env_cfg) as tools:
        _continue(engine, [(t, []) for t in trajs], sampling_cfg.max_context)  # one add: a prompt's n share its prefill
        while engine.busy() or tools.busy():
            returning, steps_before = [], engine.steps
            collected = tools.collect(engine.steps, idle=not engine.busy())
            for t, step in collected:  # the env stepped a turn
                t.steps.append(env.step_record(step))
                t.num_tool_calls += step.action.kind in ("sql", "describe", "sample", "query")
                if step.action.kind in ("solution", "answer"):
                    t.finished, t.final_sql = True, step.action.arg
                obs = observation_ids(tokenizer, step.observation, env_cfg.conversation, t.ids[-1])
                if not _end(engine, t, _end_reason(t, env_cfg, sampling_cfg, step, obs)):
                    returning.append((t, obs))
            _continue(engine, returning, sampling_cfg.max_context)
            ended = [trajs[seq.index] for seq in engine.step()]  # a turn ended: end, or run its tool call
            for t in ended:
                t.turn_spans.append((t.seq.turn_start, len(t.ids)))
            tools.submit(engine.steps, [(t, dbs[t.index], tokenizer.decode(t.ids[t.seq.turn_start:]),
                                         max_turns(env_cfg) - t.seq.num_turns)
                                        for t in ended if not _end(engine, t, _end_reason(t, env_cfg, sampling_cfg))])
            if not collected and not ended and engine.steps == steps_before:  # nothing moved: it never will
                raise RuntimeError(_stalled(trajs, tools, engine))
        if stats is not None:
            stats.update(engine_counters(engine))
    for t in trajs:
        t.num_turns, t.text = t.seq.num_turns, tokenizer.decode(t.ids[len(t.prompt_ids):])
        t.done()
    return trajs


def _stalled(trajs: list[Trajectory], tools: "ToolCalls", engine: Engine) -> str:
    """The error of a rollout iteration in which nothing moved (no tool result came back, no turn
    ended, the engine ran no forward), naming the episodes still open and where each stands."""
    open_ = [t for t in trajs if t.seq.status != "done"]
    shown = [f"episode {t.index} (turn {t.seq.num_turns}, status {t.seq.status}, {len(t.steps)} env steps, "
             f"{len(t.ids)} tokens)" for t in open_[:4]]
    return (f"rollout: an iteration at engine step {engine.steps} moved nothing ({len(tools.pending)} tool "
            f"batches pending, engine busy: {engine.busy()}); it would loop forever. Open: {', '.join(shown)}"
            + (f" and {len(open_) - 4} more" if len(open_) > 4 else ""))


def engine_counters(engine: Engine) -> dict:
    """What a rollout cost the engine: its stats (steps; per decode step summed: live_rows,
    blocks_used, tokens_live) plus evictions, prefill_tokens (tokens fed to prefill forwards:
    prompts, observations with the turn's last sampled token, recomputed rows), prompt_prefill_tokens
    (of them, new prompts': once per distinct prompt), peak_blocks (most KV blocks in use at once)
    and pool_blocks (the pool's size)."""
    sched = engine.scheduler
    return dict(engine.stats, evictions=engine.evictions, prefill_tokens=sched.prefilled_tokens,
                prompt_prefill_tokens=sched.prefilled_prompt_tokens, peak_blocks=engine.blocks.peak_used,
                pool_blocks=engine.blocks.num_blocks)


def _end_reason(t: Trajectory, env_cfg, sampling_cfg, step=None, observation=None) -> str:
    """Why the episode ends after its latest turn ("" = it goes on). The one place that decides:
    called when the turn ends (step None: should the env see it?) and after the env stepped it."""
    reason = t.seq.stop_reason
    if reason == "max_context":
        return "max_context"  # the turn was cut: no room for more
    if reason == "eos" and env_cfg.conversation == "single" and not env_cfg.eos_steps_env:
        return "eos"  # the model closed its only message
    if step is None:
        return ""
    if step.action.kind in ("solution", "answer"):
        return "solution"
    if t.seq.num_turns >= max_turns(env_cfg):
        return "max_turns"
    if len(t.ids) + len(observation) >= sampling_cfg.max_context:
        return "max_context"  # the observation leaves no room for a turn
    return ""


def _end(engine: Engine, t: Trajectory, reason: str) -> bool:
    if reason:
        t.stop_reason, t.end_reason = reason, end_reason_of(reason, t.seq.stop_reason)
        engine.finish(t.seq)
    return bool(reason)


def _continue(engine: Engine, items: list[tuple[Trajectory, list[int]]], max_context: int) -> None:
    """Append each observation (loss mask 0) and start the next turns, all in one engine.add: the
    scheduler groups identical new prompts (the n samples of an example) into one prefill."""
    seqs = []
    for t, observation in items:
        if len(t.ids) + len(observation) >= max_context:  # only a prompt can get here too long
            _end(engine, t, "max_context")
            continue
        t.ids.extend(observation)
        t.loss_mask.extend([0] * len(observation))
        t.logprobs.extend([0.0] * len(observation))
        seqs.append(t.seq)
    engine.add(seqs)


def _worst_case(t: Trajectory, env_cfg, sampling_cfg) -> int:
    """The most KV tokens one episode can reach (sizes the KV pool when the budget is larger)."""
    turns, obs_tokens = max_turns(env_cfg), 4 * env_cfg.max_obs_chars + 256  # <= 4 bytes a char, + template
    return min(sampling_cfg.max_context, len(t.prompt_ids) + turns * sampling_cfg.max_new_tokens
               + (turns - 1) * obs_tokens)


class ToolCalls:
    """The env steps of ended turns, run in background threads while the engine keeps decoding.

    The rows whose turns end at one engine step are one batch (one env.step_batch call, so its
    queries run in parallel on the SQL pool). env.tool_wait says when a batch's rows come back:

    fixed  a batch submitted at engine step s is collected at step s + env_cfg.tool_overlap_steps,
           or as soon as the engine has nothing else to do; if it is not finished by then, the
           loop waits. Which rows return when, and so every batch the engine forms, never depends
           on timing: a seeded rollout is reproducible step for step.
    async  every finished batch is collected at the next step, whatever its age; the loop waits
           (for the first batch to finish) only when the engine has nothing else to do. A slow
           query holds only its own batch's rows; the others keep decoding and batches behind it
           run on other threads. Each row still samples the same tokens (the noise of a token
           depends on its row and position only); which steps the engine batches rows in depends
           on timing. Rows of a later batch that also run SQL still queue behind a slow query in
           the SQL pool (sandbox.SqlPool runs one call at a time on its workers).
    """

    def __init__(self, env_cfg):
        if env_cfg.tool_wait not in ("fixed", "async"):
            raise ValueError(f"env.tool_wait={env_cfg.tool_wait!r}: expected 'fixed' or 'async'")
        self.cfg, self.pending = env_cfg, deque()  # (due step, trajectories, future), submission order
        self.wait_async = env_cfg.tool_wait == "async"
        threads = env_cfg.tool_threads if self.wait_async else 1
        self.thread = ThreadPoolExecutor(threads, thread_name_prefix="tool-calls")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.thread.shutdown(wait=True, cancel_futures=True)

    def busy(self) -> bool:
        return bool(self.pending)

    def submit(self, step: int, items: list[tuple[Trajectory, str, str, int]]) -> None:
        """items: (trajectory, db path, the turn's text, generations left after it)."""
        if items:
            dbs, texts, left = zip(*[i[1:] for i in items])
            future = self.thread.submit(env.step_batch, list(dbs), list(texts), list(left), self.cfg)
            self.pending.append((step + self.cfg.tool_overlap_steps, [i[0] for i in items], future))

    def collect(self, step: int, idle: bool) -> list:
        """(trajectory, env.StepResult) of every batch due at this step: fixed, those submitted
        tool_overlap_steps ago (all of them when idle); async, those finished (when idle and none
        has finished, the first to finish)."""
        if self.wait_async:
            if idle and self.pending and not any(f.done() for _, _, f in self.pending):
                wait([f for _, _, f in self.pending], return_when=FIRST_COMPLETED)
            finished = [p[2].done() for p in self.pending]  # read once: a future may finish meanwhile
            due = [p for p, done in zip(self.pending, finished) if done]
            self.pending = deque(p for p, done in zip(self.pending, finished) if not done)
        else:
            due = []
            while self.pending and (idle or self.pending[0][0] <= step):
                due.append(self.pending.popleft())
        out = []
        for _, trajs, future in due:
            out += zip(trajs, future.result())
        return out


# -----------------------------------------------------------------------------
# scripted episodes: fixed turns played through the env (the warm start's gold, the random floor)


def replay(turns: list[list[str]], db_paths: list, env_cfg, *, budget: int, tokenizer=None,
           prompt_ids: list[list[int]] | None = None, names: list | None = None) -> list[Trajectory]:
    """Episodes whose turns are written in advance (turns[i]: episode i's texts, the last one its
    answer) played through the real env (env.step_batch, one batch per turn index) and, with a
    tokenizer, tokenized exactly as rollout appends them: each turn encoded alone (mask 1; the env
    reads its decoded text, as in a rollout), each observation observation_ids of the env's own
    output (mask 0), after prompt_ids[i]. tokenizer None: text only (ids empty; text holds every
    turn and observation). budget: the generations an episode may have (at turn k the env is told
    budget - k - 1 are left). A turn that does not end at its first stop string, or that the env
    reads other than as written (a tool call, then an answer that ends the episode), raises
    ValueError naming the episode (names[i]). The SFT warm start's gold episodes
    (sft.gold_episodes) and the random-policy floor (eval.random_floor) are such episodes."""
    names = names or list(range(len(turns)))
    stops = env.STOP_STRINGS[env_cfg.protocol]
    trajs = [Trajectory.of(list(p), list(p), [0] * len(p), [0.0] * len(p))
             for p in (prompt_ids if tokenizer else [[]] * len(turns))]
    segments = [[] for _ in turns]
    for k in range(max(map(len, turns), default=0)):
        live = [i for i, t in enumerate(turns) if k < len(t)]
        said = {}
        for i in live:  # the policy's turn: encoded alone, decoded for the env as the rollout does
            t = trajs[i]
            ids = tokenizer.encode(turns[i][k], add_special_tokens=False) if tokenizer else []
            said[i] = (ids, tokenizer.decode(ids) if tokenizer else turns[i][k])
            t.turn_spans.append((len(t.ids), len(t.ids) + len(ids)))
            t.ids.extend(ids)
            t.loss_mask.extend([1] * len(ids))
            t.logprobs.extend([0.0] * len(ids))
            segments[i].append(said[i][1])
            text = said[i][1]  # the rollout ends a turn at its first stop string: a scripted one must end on it
            if min((text.find(x) + len(x) for x in stops if x in text), default=-1) != len(text):
                raise ValueError(f"scripted episode of {names[i]}: turn {k + 1} ({text!r}) does not end at its "
                                 f"first stop string {stops}")
        results = env.step_batch([str(db_paths[i]) for i in live], [said[i][1] for i in live],
                                 [budget - (k + 1)] * len(live), env_cfg)
        for i, res in zip(live, results):
            t, last = trajs[i], k == len(turns[i]) - 1
            t.steps.append(env.step_record(res))
            t.num_turns += 1
            t.num_tool_calls += res.action.kind in ("sql", "describe", "sample", "query")
            if res.action.kind == "invalid" or res.done != last or (last and res.action.kind not in ("solution", "answer")):
                raise ValueError(f"scripted episode of {names[i]}: turn {k + 1} ({said[i][1]!r}) was read as "
                                 f"{res.action.kind}, done={res.done}")
            if last:
                t.finished, t.final_sql, t.stop_reason, t.end_reason = True, res.action.arg, "solution", "answer"
                continue
            if tokenizer:
                obs = observation_ids(tokenizer, res.observation, env_cfg.conversation, said[i][0][-1])
                t.ids.extend(obs)
                t.loss_mask.extend([0] * len(obs))
                t.logprobs.extend([0.0] * len(obs))
            segments[i].append(res.observation)
    for t, segs in zip(trajs, segments):
        t.text = tokenizer.decode(t.ids[len(t.prompt_ids):]) if tokenizer else "".join(segs)
    return trajs


# -----------------------------------------------------------------------------
# episodes: rollout then reward, one typed record each


@dataclass
class Episode:
    """One episode as a step carries it from the rollout to the update (and the evals to their
    summaries): its tokens, its reward, its dataset record and its group (the index of its
    prompt in the rollout call: the n samples of a prompt share it, and advantages compare them)."""
    trajectory: Trajectory
    reward: Reward
    example: dict
    group: int


def transcript(traj: Trajectory, example: dict, db_root, final_sql: str | None = None) -> Transcript:
    """What reward.episode_rewards reads of one trajectory of one dataset record. final_sql: the
    answer to execute, when the caller rewrote it (eval.py scores its one-line predictions)."""
    return Transcript(dataset.abs_db_path(example, db_root), example["gold_sql"], traj.text,
                      traj.final_sql if final_sql is None else final_sql, traj.finished, traj.steps,
                      traj.generated_tokens)


def sample_episodes(sampler, tokenizer, examples, cfg, *, n: int, seed: int, greedy: bool = False,
                    sampling=None, answers=None, phase=None, first_group: int = 0) -> list[Episode]:
    """Rollout then reward, the one path of training steps, evals, SFT's stop check and eval.py
    generate: n episodes per example on the sampler's current weights (example-major: episode
    i*n + j is sample j of example i, group first_group + i). sampler: trainer.policy_sampler's;
    cfg: config.Config; sampling: the SamplingConfig to decode with (default cfg.sampling);
    answers(trajectory) -> the SQL to score (default its final_sql); phase(name): a context manager
    timing "rollout" and "reward" (run_log.Phases)."""
    if not sampler.refreshed:
        raise RuntimeError("sample_episodes before sampler.refresh(model): the inference copy holds no weights")
    phase = phase or (lambda name: contextlib.nullcontext())
    with phase("rollout"):  # on the sampler's inference copy, through its kept engine
        trajs = rollout(sampler.model, tokenizer, examples, cfg.env, sampling or cfg.sampling, cfg.data,
                        cfg.data.db_root, n=n, seed=seed, greedy=greedy, engine=sampler.engine)
    reps = [ex for ex in examples for _ in range(n)]
    with phase("reward"):
        scripts = [transcript(t, ex, cfg.data.db_root, answers(t) if answers else None) for t, ex in zip(trajs, reps)]
        rewards = episode_rewards(scripts, cfg.reward, cfg.env.protocol, conversation_pieces(tokenizer, cfg.env))
    return [Episode(t, r, ex, first_group + k // n) for k, (t, r, ex) in enumerate(zip(trajs, rewards, reps))]
