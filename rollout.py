"""Multi-turn text-to-SQL episodes on the sampler's engine: render, sample, parse, run the tool, observe.

    from rollout import generate, rollout
    trajs = generate(model, prompt_ids, sampling_cfg, ["</sql>"], tokenizer, seed=0)  # one turn
    trajs = rollout(model, tokenizer, examples, env_cfg, sampling_cfg, data_cfg, db_root,
                    n=5, seed=step, dtype=torch.bfloat16)                             # episodes

An episode: the prompt (chat template) is sampled until a stop string, EOS or the turn's budget;
the env parses the turn and runs its SQL; the observation's tokens are appended (loss mask 0) and
the next turn samples after them; `_end_reason` alone decides when an episode ends. Token in,
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
import functools
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from sqltask import dataset
from engine.engine import Engine
from engine.sampling import StopChecker, row_key
from engine.scheduler import Sequence
from reward import Reward, Transcript, episode_rewards


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
    finished: bool = False  # wrote a final answer (solution)
    text: str = ""  # everything after the prompt, decoded once at the end
    steps: list[dict] = field(default_factory=list)  # per env step: env.step_record (kind, arg, ok, rows)
    index: int = 0  # example index (rollout) or prompt index (generate)
    sample: int = 0  # sample index within the example's group

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
# tokens around the model's turns


def render_prompt(tokenizer, example: dict, data_cfg, protocol: str, db_root) -> list[int]:
    """Prompt ids of one example: its chat messages rendered with the generation prompt."""
    from sqltask import prompts as prompt_lib
    msgs = prompt_lib.build_messages(example, db_root, data_cfg, protocol=protocol)
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def eos_ids(tokenizer) -> list[int]:
    """EOS ids: the tokenizer's eos plus <|im_end|> / <|endoftext|> when the vocab has them."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
    return sorted(i for i in ids if i is not None)


@functools.lru_cache(maxsize=16)
def conversation_wrapper(tokenizer) -> tuple[str, str, str]:
    """(close, before, after) around an observation in the conversation format: `close` ends the
    assistant turn (an EOS token such as <|im_end|>; skipped when the model sampled it),
    `before` opens a user message, `after` closes it and opens the next assistant turn. Found by
    rendering only a dummy exchange with the chat template (template-suffix differencing); the
    real history is never re-rendered."""
    A, O = "\u2063ASSISTANT\u2063", "\u2063OBSERVATION\u2063"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": A}, {"role": "user", "content": O}]
    s = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    a, o = s.index(A) + len(A), s.index(O)
    head = s[a:o]  # e.g. "<|im_end|>\n<|im_start|>user\n"
    close = next((e for e in tokenizer.convert_ids_to_tokens(eos_ids(tokenizer)) if head.startswith(e)), "")
    return close, head[len(close):], s[o + len(O):]


def conversation_pieces(tokenizer, env_cfg) -> tuple[str, ...]:
    """The chat-template text that the conversation format (env.conversation = conversation)
    inserts between an assistant turn and an observation (conversation_wrapper), which
    reward.format_ok removes before its rules run; () in the single-message format, which inserts none."""
    if getattr(env_cfg, "conversation", "single") != "conversation":
        return ()
    return tuple(p for p in conversation_wrapper(tokenizer) if p)


def observation_ids(tokenizer, observation: str, conversation: str, last_id: int | None = None) -> list[int]:
    """The ids appended after a turn (tokenized once): the env's observation text as it is in the
    single-message format; in the conversation format the assistant turn closed (unless its last
    sampled token `last_id` already closed it), the observation as a user message and a new
    assistant turn opened, exactly as the chat template renders the whole conversation."""
    if conversation == "conversation":
        close, before, after = conversation_wrapper(tokenizer)
        sampled_close = close and last_id == tokenizer.convert_tokens_to_ids(close)
        observation = ("" if sampled_close else close) + before + observation.strip() + after
    return tokenizer.encode(observation, add_special_tokens=False)


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
    tokens, peak blocks, ...). engine: a persistent Engine on `model` (policy_sampler.py) reset and
    reused, its pool, buffers and graphs kept; default a new one for this rollout, freed after.
    Returns P*n Trajectories."""
    import env
    prompts = [render_prompt(tokenizer, ex, data_cfg, env_cfg.protocol, db_root) for ex in examples]
    dbs = [dataset.abs_db_path(ex, db_root) for ex in examples]
    trajs = [Trajectory.start(p, row_key(seed, i * n + j), i, j, i * n + j) for i, p in enumerate(prompts) for j in range(n)]
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
            returning = []
            for t, step in tools.collect(engine.steps, idle=not engine.busy()):  # the env stepped a turn
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
        if stats is not None:
            stats.update(engine_counters(engine))
    for t in trajs:
        t.num_turns, t.text = t.seq.num_turns, tokenizer.decode(t.ids[len(t.prompt_ids):])
        t.done()
    return trajs


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
        t.stop_reason = reason
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
            import env
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
                      traj.final_sql if final_sql is None else final_sql, traj.finished, traj.steps)


def sample_episodes(sampler, tokenizer, examples, cfg, *, n: int, seed: int, greedy: bool = False,
                    sampling=None, answers=None, phase=None, first_group: int = 0) -> list[Episode]:
    """Rollout then reward, the one path of training steps, evals, SFT's stop check and eval.py
    generate: n episodes per example on the sampler's current weights (example-major: episode
    i*n + j is sample j of example i, group first_group + i). sampler: trainer.policy_sampler's;
    cfg: config.Config; sampling: the SamplingConfig to decode with (default cfg.sampling);
    answers(trajectory) -> the SQL to score (default its final_sql); phase(name): a context manager
    timing "rollout" and "reward" (run_log.Phases)."""
    phase = phase or (lambda name: contextlib.nullcontext())
    with phase("rollout"):
        trajs = sampler.rollout(tokenizer, examples, cfg.env, cfg.data, cfg.data.db_root,
                                sampling_cfg=sampling or cfg.sampling, n=n, seed=seed, greedy=greedy)
    reps = [ex for ex in examples for _ in range(n)]
    with phase("reward"):
        scripts = [transcript(t, ex, cfg.data.db_root, answers(t) if answers else None) for t, ex in zip(trajs, reps)]
        rewards = episode_rewards(scripts, cfg.reward, cfg.env.protocol, conversation_pieces(tokenizer, cfg.env))
    return [Episode(t, r, ex, first_group + k // n) for k, (t, r, ex) in enumerate(zip(trajs, rewards, reps))]
