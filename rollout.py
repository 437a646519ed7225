"""Batched KV-cached sampling and the multi-turn text-to-SQL tool loop.

    from rollout import generate, rollout
    trajs = generate(model, prompt_ids, sampling_cfg, ["</sql>"], tokenizer, seed=0)  # one turn
    trajs = rollout(model, tokenizer, examples, env_cfg, sampling_cfg, data_cfg, db_root,
                    n=5, seed=step)                                                   # episodes

How it runs (one engine for both):
- Trajectories run in waves of at most kv_budget_tokens // row_cap rows. In a wave, identical
  prompts are prefilled once (right padded, chunk_lens) and the cache rows are copied into the
  G samples (KVCache.select with repeats).
- A turn decodes all live rows one token per step. A row stops on EOS, a stop string (found on
  a few tail tokens, see sampling.StopChecker), max_new_tokens or max_context. When a fraction
  compact_frac of the batch has stopped, stopped rows leave the batch (select), so compute
  follows live rows; rows that may continue are parked with their cache until the turn ends.
- After a turn, the env runs all rows' SQL in one batch; each continuing row gets its last
  sampled token + the observation tokens (tokenized once) appended in ONE forward for all rows
  (chunk_lens). Loss mask 1 exactly on sampled tokens; ids are never re-tokenized.
- Randomness is counter-based per (seed, trajectory, position) (sampling.py), so the samples do
  not depend on waves, batch composition or compaction.

Tests: .venv/bin/pytest tests/test_rollout.py   Benchmarks: bench/sampler.py, bench/multiturn.py
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from model import KVCache
from sampling import StopChecker, row_key, sample_next


@dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int]  # prompt + all turns (sampled, observation and template tokens)
    loss_mask: list[int]  # aligned to ids: 1 exactly on sampled tokens (incl. stop string, EOS)
    logprobs: list[float]  # aligned to ids: log softmax(logits/T) of sampled tokens, 0 elsewhere
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each turn in ids
    num_turns: int = 0
    num_tool_calls: int = 0
    final_sql: str = ""
    stop_reason: str = ""  # solution|max_turns|max_context|eos|invalid|done (generate: stop|eos|length|max_context)
    finished: bool = False  # wrote a final answer (solution)
    text: str = ""  # everything after the prompt, decoded once at the end
    steps: list[dict] = field(default_factory=list)  # per env step: env.step_record (kind, arg, ok, rows)
    index: int = 0  # example index (rollout) or prompt index (generate)
    sample: int = 0  # sample index within the example's group


class _Row:  # sampler state of one trajectory
    __slots__ = ("t", "key", "start", "budget", "ctx_limited", "reason", "pending", "key_index")

    def __init__(self, t: Trajectory, key: int, key_index: int = 0):
        self.t, self.key, self.start, self.budget, self.key_index = t, key, 0, 0, key_index
        self.ctx_limited, self.reason, self.pending = False, "", None


# -----------------------------------------------------------------------------
# cache plumbing


def _feed(model, cache: KVCache, chunks: list[list[int]], max_tokens: int = 16384) -> torch.Tensor:
    """Append chunks[b] to row b of the cache (right padded, chunk_lens; empty = untouched) and
    return the logits after each row's last token, (B, V) (undefined for empty chunks). Long
    chunks go in pieces of ~max_tokens padded tokens per forward (bounds the attention mask)."""
    B, lens = len(chunks), [len(c) for c in chunks]
    dev = cache.lengths.device
    step = max(1, max_tokens // B)
    out = None
    for s in range(0, max(lens), step):
        part = [c[s:s + step] for c in chunks]
        w = max(len(p) for p in part)
        x = torch.tensor([p + [0] * (w - len(p)) for p in part], dtype=torch.long, device=dev)  # (B, w)
        cl = torch.tensor([len(p) for p in part], dtype=torch.long, device=dev)  # (B,)
        last = model(x, cache=cache, chunk_lens=None if all(len(p) == w for p in part) else cl,
                     logits_at=(cl - 1).clamp(min=0))  # (B, V)
        ends = torch.tensor([s < n <= s + step for n in lens], device=dev)[:, None]
        out = last if out is None else torch.where(ends, last, out)
    return out


def _merge(parts: list[tuple[KVCache, list[int]]], max_len: int) -> KVCache:
    """One cache of the given rows of several caches, in order, with room for max_len tokens."""
    c0 = parts[0][0]
    L, _, H, _, D = c0.k.shape
    n = sum(len(idx) for _, idx in parts)
    new = KVCache(L, n, H, max_len, D, c0.k.dtype, c0.k.device)
    off, lengths = 0, []
    for c, idx in parts:
        if not idx:
            continue
        i = torch.tensor(idx, dtype=torch.long, device=c.lengths.device)
        used = int(c.lengths[i].max())  # slots past a row's length are masked (and finite)
        new.k[:, off:off + len(idx), :, :used] = c.k[:, i, :, :used]
        new.v[:, off:off + len(idx), :, :used] = c.v[:, i, :, :used]
        lengths.append(c.lengths[i])
        off += len(idx)
    new.lengths = torch.cat(lengths)
    return new


# -----------------------------------------------------------------------------
# the engine: waves -> prefill -> (decode turn -> env -> extend)*


class _HookRow:  # what a logits hook sees of a row (ids, turn_start, num_turns, index)
    __slots__ = ("ids", "turn_start", "num_turns", "index")

    def __init__(self, r):
        self.ids, self.turn_start, self.num_turns, self.index = r.t.ids, r.start, r.t.num_turns, r.key_index


def _decode_turn(model, cache, rows, logits, sc, stopper, greedy, may_continue, hook=None):
    """Sample until every row has stopped. logits (B, V): next-token logits of each row.
    Returns the parked pieces [(cache, rows)] of stopped rows whose reason is in may_continue."""
    dev = cache.lengths.device
    keys = torch.tensor([r.key for r in rows], dtype=torch.long, device=dev)  # (B,)
    live, pieces = [True] * len(rows), []
    compact_frac = sc.compact_frac
    while True:
        if hook is not None:
            logits = hook(logits, [_HookRow(r) for r in rows])
        # positions for the counter-based noise = tokens already in the trajectory = cache length
        tok, lp = sample_next(logits, keys, cache.lengths, temperature=sc.temperature,
                              top_p=sc.top_p, top_k=sc.top_k, greedy=greedy)  # (B,), (B,)
        vals = torch.stack([tok.double(), lp.double()], 1).tolist()  # one host sync per step
        for i, r in enumerate(rows):
            if not live[i]:
                continue
            t = r.t
            t.ids.append(int(vals[i][0]))
            t.loss_mask.append(1)
            t.logprobs.append(vals[i][1])
            reason = stopper.check(t.ids, r.start)
            if reason is None and len(t.ids) - r.start >= r.budget:
                reason = "max_context" if r.ctx_limited else "length"
            if reason:
                r.reason, live[i] = reason, False
        n_live = sum(live)
        if n_live == 0 or len(rows) - n_live >= max(1.0, compact_frac * len(rows)):
            # compaction: stopped rows leave the batch (parked if they may continue)
            park = [i for i, r in enumerate(rows) if not live[i] and r.reason in may_continue]
            if park:
                pieces.append((cache, [rows[i] for i in park]) if n_live == 0 and len(park) == len(rows)
                              else (cache.select(torch.tensor(park, device=dev)), [rows[i] for i in park]))
            if n_live == 0:
                return pieces
            keep = torch.tensor([i for i in range(len(rows)) if live[i]], device=dev)
            cache, keys, tok = cache.select(keep), keys[keep], tok[keep]
            rows = [rows[i] for i in keep.tolist()]
            live = [True] * n_live
        cl = None if n_live == len(rows) else torch.tensor(live, dtype=torch.long, device=dev)
        logits = model(tok[:, None], cache=cache, chunk_lens=cl)[:, -1]  # (B, V)


def _engine(model, trajs, keys, sc, stopper, greedy, row_cap, end_turn, may_continue, max_context, hook=None):
    """Run trajectories (prompt already in t.ids) to the end, in waves. end_turn(rows) -> per row
    the ids to append before the next turn (the row continues) or None (it ended)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            per_wave = max(1, sc.kv_budget_tokens // max(1, row_cap))
            for w in range(0, len(trajs), per_wave):
                rows = []
                for i, (t, k) in enumerate(zip(trajs[w:w + per_wave], keys[w:w + per_wave])):
                    if len(t.ids) >= max_context:
                        t.stop_reason = "max_context"
                    else:
                        rows.append(_Row(t, k, w + i))
                if rows:
                    _wave(model, rows, sc, stopper, greedy, end_turn, may_continue, max_context, row_cap, hook)
    finally:
        model.train(was_training)


def _wave(model, rows, sc, stopper, greedy, end_turn, may_continue, max_context, row_cap, hook=None):
    dev = next(model.parameters()).device
    uniq: dict[tuple, int] = {}
    src = [uniq.setdefault(tuple(r.t.ids), len(uniq)) for r in rows]  # shared prompt prefill
    longest = max(len(r.t.ids) for r in rows)
    cache = KVCache.for_model(model, len(uniq), min(max_context, longest + sc.max_new_tokens))
    logits = _feed(model, cache, [list(u) for u in uniq])  # (P, V)
    if src != list(range(len(uniq))):  # G samples of a prompt: copy its cache rows (P*G rows)
        src_t = torch.tensor(src, dtype=torch.long, device=dev)
        cache, logits = cache.select(src_t), logits[src_t]
    while rows:
        for r in rows:
            r.start, r.t.num_turns = len(r.t.ids), r.t.num_turns + 1
            r.budget = min(sc.max_new_tokens, max_context - len(r.t.ids))
            r.ctx_limited = r.budget < sc.max_new_tokens
        pieces = _decode_turn(model, cache, rows, logits, sc, stopper, greedy, may_continue, hook)
        for r in rows:
            r.t.turn_spans.append((r.start, len(r.t.ids)))
        for r, app in zip(rows, end_turn(rows)):
            r.pending = None if app is None else [r.t.ids[-1]] + list(app)  # last sampled token is not cached yet
            if app is not None:
                r.t.ids.extend(app)
                r.t.loss_mask.extend([0] * len(app))
                r.t.logprobs.extend([0.0] * len(app))
        parts = [(c, [i for i, r in enumerate(pr) if r.pending is not None]) for c, pr in pieces]
        rows = [pr[i] for (_, pr), (_, idx) in zip(pieces, parts) for i in idx]
        if not rows:
            return
        need = max(min(max_context, len(r.t.ids) + sc.max_new_tokens) for r in rows)
        c0 = parts[0][0]
        if len(parts) == 1 and len(rows) == c0.lengths.shape[0] and need <= c0.max_len:
            cache = c0  # every row continues and fits: no copy
        else:  # grow geometrically (fewer copies), within the row cap the kv budget assumed
            cache = _merge(parts, max(need, min(row_cap, 2 * c0.max_len)))
        logits = _feed(model, cache, [r.pending for r in rows])  # one forward for all observations


# -----------------------------------------------------------------------------
# public API


def eos_ids(tokenizer) -> list[int]:
    """EOS ids: the tokenizer's eos plus <|im_end|> / <|endoftext|> when the vocab has them."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
    return sorted(i for i in ids if i is not None)


def generate(model, prompts: list[list[int]], cfg, stop_strings, tokenizer, *, seed: int,
             greedy: bool = False, eos: list[int] | None = None, logits_hook=None) -> list[Trajectory]:
    """Single-turn batched sampling. prompts: token ids; cfg: config.SamplingConfig.
    eos: ids that end a row (default eos_ids(tokenizer); [] ignores EOS). Returns one Trajectory
    per prompt (num_turns 1, stop_reason stop|eos|length|max_context)."""
    eos = eos_ids(tokenizer) if eos is None else eos
    stopper = StopChecker(tokenizer, stop_strings, eos, model.config.vocab_size)
    trajs = [Trajectory(list(p), list(p), [0] * len(p), [0.0] * len(p), index=i) for i, p in enumerate(prompts)]
    keys = [row_key(seed, i) for i in range(len(prompts))]

    def end_turn(rows):
        for r in rows:
            r.t.stop_reason = r.reason
        return [None] * len(rows)

    row_cap = min(cfg.max_context, max(len(p) for p in prompts) + cfg.max_new_tokens)
    _engine(model, trajs, keys, cfg, stopper, greedy, row_cap, end_turn, set(), cfg.max_context, logits_hook)
    if tokenizer is not None:
        for t in trajs:
            t.text = tokenizer.decode(t.ids[len(t.prompt_ids):])
    return trajs


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


def render_prompt(tokenizer, example: dict, data_cfg, protocol: str, db_root) -> list[int]:
    """Prompt ids of one example: its chat messages rendered with the generation prompt."""
    import prompts as prompt_lib
    msgs = prompt_lib.build_messages(example, db_root, data_cfg, protocol=protocol)
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _db_path(ex: dict, db_root) -> str:
    p = ex["db_path"]
    return p if os.path.isabs(p) or not db_root else os.path.join(db_root, p)


def rollout(model, tokenizer, examples, env_cfg, sampling_cfg, data_cfg, db_root, *, n: int = 1,
            seed: int = 0, greedy: bool = False, logits_hook=None) -> list[Trajectory]:
    """Multi-turn episodes, n samples per example (example-major: index i*n + j is sample j of
    example i). Each example needs db_path (absolute or relative to db_root) + what
    prompts.build_messages reads (question, evidence, ...). Returns P*n Trajectories."""
    import env

    protocol, conv = env_cfg.protocol, env_cfg.conversation == "conversation"
    eos = eos_ids(tokenizer)
    stopper = StopChecker(tokenizer, env.STOP_STRINGS[protocol], eos, model.config.vocab_size)
    close, before, after = conversation_wrapper(tokenizer) if conv else ("", "", "")
    close_id = tokenizer.convert_tokens_to_ids(close) if close else None
    max_context = sampling_cfg.max_context
    prompt_ids = [render_prompt(tokenizer, ex, data_cfg, protocol, db_root) for ex in examples]
    trajs = [Trajectory(list(p), list(p), [0] * len(p), [0.0] * len(p), index=i, sample=j)
             for i, p in enumerate(prompt_ids) for j in range(n)]
    keys = [row_key(seed, i) for i in range(len(trajs))]
    dbs = [_db_path(ex, db_root) for ex in examples]
    tool_kinds = {"sql", "describe", "sample", "query"}

    def end_turn(rows):
        out = [None] * len(rows)
        todo = []
        for j, r in enumerate(rows):
            if r.reason == "max_context" or (r.reason == "eos" and not conv):
                r.t.stop_reason = r.reason  # out of room, or the model closed its only message
            else:
                todo.append(j)
        if not todo:
            return out
        texts = [tokenizer.decode(rows[j].t.ids[rows[j].start:]) for j in todo]
        left = [env_cfg.max_turns - rows[j].t.num_turns for j in todo]
        results = env.step_batch([dbs[rows[j].t.index] for j in todo], texts, left, env_cfg)
        for j, k, res in zip(todo, left, results):
            t, a = rows[j].t, res.action
            t.steps.append(env.step_record(res))
            t.num_tool_calls += a.kind in tool_kinds
            if a.kind in ("solution", "answer"):
                t.finished, t.final_sql, t.stop_reason = True, a.arg, "solution"
            elif res.done or k <= 0:
                t.stop_reason = "max_turns" if k <= 0 else ("invalid" if a.kind == "invalid" else "done")
            else:
                if conv:  # close the turn (unless EOS was sampled), user message, open assistant
                    c = "" if t.ids[-1] == close_id else close
                    obs = c + before + res.observation.strip() + after
                else:
                    obs = res.observation
                ids = tokenizer.encode(obs, add_special_tokens=False)  # tokenized once
                if len(t.ids) + len(ids) >= max_context:
                    t.stop_reason = "max_context"
                else:
                    out[j] = ids
        return out

    obs_cap = env_cfg.max_obs_chars + 256  # rough token bound of one observation
    turns = env_cfg.max_turns
    row_cap = min(max_context, max(map(len, prompt_ids), default=1)
                  + turns * sampling_cfg.max_new_tokens + (turns - 1) * obs_cap)
    may_continue = {"stop", "length"} | ({"eos"} if conv else set())
    _engine(model, trajs, keys, sampling_cfg, stopper, greedy, row_cap, end_turn, may_continue,
            max_context, logits_hook)
    for t in trajs:
        t.text = tokenizer.decode(t.ids[len(t.prompt_ids):])
    return trajs
