"""Multi-turn text-to-SQL episodes on the sampler's engine: render, sample, parse, run the tool,
observe; then reward them, one typed Episode each (what a GRPO step carries to the update).

    episodes = sample_episodes(sampler, tok, examples, cfg, n=G, seed=s)   # rollout then reward: Episode list
    trajs = rollout(model, tok, examples, env_cfg, sampling_cfg, data_cfg, db_root, n=5, seed=s)  # the loop
    with EpisodeLoop(engine, tok, env_cfg) as loop: loop.add(trajs, dbs); loop.advance() ...  # episodes join any time
    trajs = generate(model, prompt_ids, sampling_cfg, ["</sql>"], tokenizer, seed=0)  # one turn
(Scripted episodes, played through the env without sampling: replay.py.)

An episode: the prompt (chat template) is sampled until a stop string, EOS or the turn's budget;
the env parses the turn and runs its SQL; the observation's tokens are appended (loss mask 0) and
the next turn samples after them; `_end_reason` alone decides when an episode ends, and
END_REASONS names why (Trajectory.end_reason; TRUNCATED: those that ran out of room), while the
engine's names say why a turn stopped (Trajectory.turn_stop: stop, eos, length, max_context). Token in,
token out: ids are never re-tokenized, the loss mask is 1 exactly on sampled tokens, logprobs are
the sampler's (log softmax of logits / temperature). The engine (engine/engine.py: paged KV cache,
continuous batching) keeps every row's cache between turns. All episodes start in one engine.add,
so the n samples of an example are prefilled once and share the prompt's KV blocks (an
observation extends only its own row; the shared, partly filled last block is copied on first
write). Rows that ended a turn wait for their tool calls in background threads while the others
keep decoding (ToolCalls; env.tool_wait: fixed = collected a fixed number of engine steps later,
async = as soon as they arrive). Randomness is counter-based per (seed, trajectory, position)
(engine/sampling.py): batching, sharing, evictions and timing never change a sample. Every
sampled token also records the version of the weights that sampled it (Trajectory.versions:
Engine.version, which stream.py sets to the GRPO step whose weights the sampler holds; rollout()
leaves it as it is).

Tests: .venv/bin/pytest tests/test_rollout.py tests/test_engine.py tests/test_rollout_share.py
Benchmarks: bench/sampler.py, bench/multiturn.py, bench/rollout_scale.py
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import env
from engine.engine import Engine
from engine.sampling import StopChecker, row_key
from engine.scheduler import Sequence
from reward import Reward, Transcript, episode_rewards
from sqltask import dataset
from sqltask.tool_calls import ToolCalls
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
    end_reason: str = ""  # why the episode ended: a key of END_REASONS (turn_stop: why its last turn stopped)
    finished: bool = False  # wrote a final answer (solution)
    text: str = ""  # everything after the prompt, decoded once at the end
    steps: list[dict] = field(default_factory=list)  # per env step: env.step_record (kind, arg, ok, rows)
    index: int = 0  # example index (rollout) or prompt index (generate)
    sample: int = 0  # sample index within the example's group

    @property
    def truncated(self) -> bool:  # it ran out of room (TRUNCATED), not out of turns or answered
        return self.end_reason in TRUNCATED

    @property
    def turn_stop(self) -> str:  # why its last turn stopped, the engine's name: stop | eos | length | max_context
        return self.seq.stop_reason

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

    @property
    def versions(self) -> list[int]:  # aligned to ids: the policy version that sampled each token, 0 elsewhere
        return self.seq.versions

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

    def token_ages(self, step: int) -> list[int]:
        """Each loss token's age at the trainer's step `step`: step minus the version of the weights
        that sampled it (versions), in the order token_turns lists the tokens. 0 for every token of
        a synchronous step; up to stream.sampling_steps_ahead when sampling runs ahead."""
        return [step - v for v, m in zip(self.versions[1:], self.loss_mask[1:]) if m]

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


# A one-turn episode (generate: no env reads it) ends when its turn does: its one turn spent at the stop
# string ("turn_budget"), or cut by sampling.max_new_tokens or max_context, or closed by EOS
GENERATE_END = {"stop": "turn_budget", "length": "turn_cut", "max_context": "context", "eos": "eos"}


def generate(model, prompts: list[list[int]], cfg, stop_strings, tokenizer, *, seed: int, greedy: bool = False,
             eos: list[int] | None = None, dtype=None, logits_hook=None) -> list[Trajectory]:
    """Single-turn batched sampling. prompts: token ids; cfg: config.SamplingConfig.
    eos: ids that end a row (default eos_ids(tokenizer); [] ignores EOS). Returns one Trajectory
    per prompt: one turn (turn_stop: stop | eos | length | max_context), its end_reason the END_REASONS
    name of a one-turn episode's end (GENERATE_END)."""
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
        t.seq.stop_reason = t.seq.stop_reason or "max_context"  # a prompt too long to start
        t.num_turns, t.end_reason = t.seq.num_turns, GENERATE_END[t.turn_stop]
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
            engine: Engine | None = None, starts: tuple[list, list] | None = None) -> list[Trajectory]:
    """Multi-turn episodes, n samples per example (example-major: index i*n + j is sample j of
    example i). Each example needs db_path (absolute or relative to db_root) + what
    prompts.build_messages reads (question, evidence, ...). dtype: the KV cache's (the compute
    dtype; default the parameters'). stats: a dict to fill with Engine.counters (prefilled
    tokens, peak blocks, ...). engine: a persistent Engine on `model` (trainer/policy_sampler.py) reset and
    reused, its pool, buffers and graphs kept; default a new one for this rollout, freed after.
    starts: (Trajectory.start episodes, their database paths) to run instead of fresh ones of
    `examples`: a conversation already under way as the prompt (bench/recovery_probe.py); the env
    then allows env_cfg's turns after it. Returns P*n Trajectories (or the starts)."""
    trajs, dbs = starts or start_episodes(tokenizer, examples, env_cfg, data_cfg, db_root, n=n, seed=seed)
    stopper = episode_stopper(tokenizer, env_cfg, model.config.vocab_size)
    worst = [worst_case(t, env_cfg, sampling_cfg) for t in trajs]
    if engine is None:
        run = Engine(model, sampling_cfg, stopper, worst_case=worst, greedy=greedy, dtype=dtype, logits_hook=logits_hook)
    else:
        if engine.model is not model:
            raise ValueError("rollout: a persistent engine samples its own model: pass engine.model")
        engine.reset(stopper, worst_case=worst, greedy=greedy, logits_hook=logits_hook, cfg=sampling_cfg)
        run = contextlib.nullcontext(engine)
    with run as engine, EpisodeLoop(engine, tokenizer, env_cfg) as loop:
        loop.add(trajs, dbs)  # one add: a prompt's n samples share its prefill
        while loop.busy():
            loop.advance()
        if stats is not None:
            stats.update(engine.counters())
    return trajs


def start_episodes(tokenizer, examples, env_cfg, data_cfg, db_root, *, n: int, seed: int,
                   first: int = 0) -> tuple[list[Trajectory], list[str]]:
    """n fresh episodes per example (example-major) and each one's database path. Episode k (k =
    i*n + j) samples with key row_key(seed, k); `first` numbers its engine sequence first + k (ids
    unique within one EpisodeLoop)."""
    prompt_ids = [render_prompt(tokenizer, ex, data_cfg, env_cfg.protocol, db_root) for ex in examples]
    trajs = [Trajectory.start(p, row_key(seed, i * n + j), i, j, first + i * n + j)
             for i, p in enumerate(prompt_ids) for j in range(n)]
    return trajs, [dataset.abs_db_path(examples[t.index], db_root) for t in trajs]


def episode_stopper(tokenizer, env_cfg, vocab_size: int) -> StopChecker:
    """Where a turn ends: the protocol's stop strings (kept) or EOS."""
    return StopChecker(tokenizer, env.STOP_STRINGS[env_cfg.protocol], eos_ids(tokenizer), vocab_size)


def worst_case(t: Trajectory, env_cfg, sampling_cfg) -> int:
    """The most KV tokens one episode can reach (sizes the KV pool when the budget is larger)."""
    turns, obs_tokens = max_turns(env_cfg), 4 * env_cfg.max_obs_chars + 256  # <= 4 bytes a char, + template
    return min(sampling_cfg.max_context, len(t.prompt_ids) + turns * sampling_cfg.max_new_tokens
               + (turns - 1) * obs_tokens)


class EpisodeLoop:
    """The multi-turn loop on one engine: episodes join at any time (add) and move one engine step
    at a time (advance); an episode leaves when _end_reason says so. rollout() adds its whole batch
    and advances until none is open; a GRPO step's stream (stream.py) keeps one loop across steps.

    advance(): the tool results due come back (ToolCalls) and their episodes end or continue with
    the observation appended; the engine runs one forward (a prefill, or a decode window); the
    turns that ended either end their episode or go to the env in the background. `clock` counts
    the engine steps this loop ran (the tool calls are due by it), whatever resets the engine saw."""

    def __init__(self, engine: Engine, tokenizer, env_cfg):
        self.engine, self.tokenizer, self.env_cfg = engine, tokenizer, env_cfg
        self.tools = ToolCalls(env_cfg, env.step_batch)
        self.open: dict[int, tuple[Trajectory, str]] = {}  # engine sequence index -> (episode, db path)
        self.clock = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.tools.close()

    def busy(self) -> bool:
        return bool(self.open)

    @property
    def max_context(self) -> int:  # the engine's run's (its reset may change the sampling config)
        return self.engine.cfg.max_context

    def add(self, trajs: list[Trajectory], dbs: list[str]) -> list[Trajectory]:
        """Start episodes (fresh ones, Trajectory.start), all in one engine.add: the scheduler groups
        identical prompts (the n samples of an example) into one prefill. Returns those that ended at
        once (a prompt with no room below sampling.max_context: end_reason "context")."""
        for t, db in zip(trajs, dbs):
            self.open[t.seq.index] = (t, db)
        ended = []
        self._continue([(t, []) for t in trajs], ended)
        return ended

    def advance(self) -> list[Trajectory]:
        """One iteration: returned tool results, then one engine step, then the tool calls of the
        turns that ended. Returns the episodes that ended in it (finished: Trajectory.end_reason set,
        text decoded, blocks released). Raises when nothing moved (it never would again)."""
        engine, env_cfg = self.engine, self.env_cfg
        returning, ended_episodes, steps_before = [], [], engine.steps
        collected = self.tools.collect(self.clock, idle=not engine.busy())
        for t, step in collected:  # the env stepped a turn
            t.steps.append(env.step_record(step))
            t.num_tool_calls += step.action.kind in ("sql", "describe", "sample", "query")
            if step.action.kind in ("solution", "answer"):
                t.finished, t.final_sql = True, step.action.arg
            obs = observation_ids(self.tokenizer, step.observation, env_cfg.conversation, t.ids[-1])
            if self._end(t, _end_reason(t, env_cfg, self.max_context, step, obs), ended_episodes):
                continue
            returning.append((t, obs))
        self._continue(returning, ended_episodes)
        ended = [self.open[seq.index][0] for seq in engine.step()]  # a turn ended: end, or run its tool call
        self.clock += engine.steps - steps_before
        for t in ended:
            t.turn_spans.append((t.seq.turn_start, len(t.ids)))
        self.tools.submit(self.clock, [(t, self.open[t.seq.index][1], self.tokenizer.decode(t.ids[t.seq.turn_start:]),
                                        max_turns(env_cfg) - t.seq.num_turns)
                                       for t in ended if not self._end(t, _end_reason(t, env_cfg, self.max_context),
                                                                       ended_episodes)])
        if not collected and not ended and engine.steps == steps_before:  # nothing moved: it never will
            raise RuntimeError(self._stalled())
        return ended_episodes

    def _end(self, t: Trajectory, reason: str, ended: list[Trajectory]) -> bool:
        """End the episode when reason is set (an END_REASONS name): its blocks go back, its text is decoded."""
        if reason:
            t.end_reason = reason
            self.engine.finish(t.seq)
            t.num_turns, t.text = t.seq.num_turns, self.tokenizer.decode(t.ids[len(t.prompt_ids):])
            t.done()
            del self.open[t.seq.index]
            ended.append(t)
        return bool(reason)

    def _continue(self, items: list[tuple[Trajectory, list[int]]], ended: list[Trajectory]) -> None:
        """Append each observation (loss mask 0) and start the next turns, all in one engine.add."""
        seqs = []
        for t, observation in items:
            if len(t.ids) + len(observation) >= self.max_context:  # only a prompt can get here too long
                self._end(t, "context", ended)
                continue
            t.seq.extend(observation)
            seqs.append(t.seq)
        self.engine.add(seqs)

    def _stalled(self) -> str:
        """The error of an iteration in which nothing moved (no tool result came back, no turn
        ended, the engine ran no forward), naming the episodes still open and where each stands."""
        open_ = [t for t, _ in self.open.values()]
        shown = [f"episode {t.index} (turn {t.seq.num_turns}, status {t.seq.status}, {len(t.steps)} env steps, "
                 f"{len(t.ids)} tokens)" for t in open_[:4]]
        return (f"rollout: an iteration at engine step {self.engine.steps} moved nothing ({len(self.tools.pending)} "
                f"tool batches pending, engine busy: {self.engine.busy()}); it would loop forever. Open: "
                f"{', '.join(shown)}" + (f" and {len(open_) - 4} more" if len(open_) > 4 else ""))


def _end_reason(t: Trajectory, env_cfg, max_context: int, step=None, observation=None) -> str:
    """Why the episode ends after its latest turn, an END_REASONS name ("" = it goes on). The one
    place that decides: called when the turn ends (step None: should the env see it?) and after the
    env stepped it. t.turn_stop is the engine's reason for the turn's end."""
    if t.turn_stop == "max_context":
        return "context"  # the turn was cut: no room for more
    if t.turn_stop == "eos" and env_cfg.conversation == "single" and not env_cfg.eos_steps_env:
        return "eos"  # the model closed its only message
    if step is None:
        return ""
    if step.action.kind in ("solution", "answer"):
        return "answer"
    if t.seq.num_turns >= max_turns(env_cfg):
        return "turn_cut" if t.turn_stop == "length" else "turn_budget"
    if len(t.ids) + len(observation) >= max_context:
        return "context"  # the observation leaves no room for a turn
    return ""


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
    """Rollout then reward, the one path of evals, SFT's stop check and eval.py generate (a training
    step's rounds run the same loop and reward_episodes through stream.py): n episodes per example on the sampler's current weights (example-major: episode
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
    with phase("reward"):
        return reward_episodes(trajs, examples, tokenizer, cfg, n=n, first_group=first_group, answers=answers)


def reward_episodes(trajs: list[Trajectory], examples: list[dict], tokenizer, cfg, *, n: int, first_group: int = 0,
                    answers=None) -> list[Episode]:
    """Reward ended episodes, n per example (example-major, as start_episodes lays them out), all
    their SQL in one pool call: one Episode each, group first_group + i for example i."""
    reps = [ex for ex in examples for _ in range(n)]
    scripts = [transcript(t, ex, cfg.data.db_root, answers(t) if answers else None) for t, ex in zip(trajs, reps)]
    rewards = episode_rewards(scripts, cfg.reward, cfg.env.protocol, conversation_pieces(tokenizer, cfg.env))
    return [Episode(t, r, ex, first_group + k // n) for k, (t, r, ex) in enumerate(zip(trajs, rewards, reps))]
