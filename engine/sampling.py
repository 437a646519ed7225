"""Token sampling and stop-string detection for the sampler (rollout.py).

Counter-based randomness: every sampled token draws one uniform u = hash(row_key, position),
where row_key is derived from (seed, trajectory index) and position is the token's index in its
trajectory. The draw therefore does not depend on which other rows share the batch, on
compaction, or on waves; u is turned into a token by inverse-CDF sampling over the (temperature,
top-k, top-p filtered) distribution, so only B random numbers are needed per step (no
torch.multinomial, no per-row generators).

    tok, logp = sample_next(logits, keys, positions, temperature=0.6, top_p=0.95)
    stop = StopChecker(tokenizer, ["</sql>", "</solution>"], eos_ids=[tokenizer.eos_token_id])
    stop.check(ids, turn_start)  # -> "eos" | "stop" | None (looks at the last few ids only)

Tests: .venv/bin/pytest tests/test_rollout.py
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# -----------------------------------------------------------------------------
# counter-based uniforms (splitmix64 in wrapping int64 arithmetic)

_MASK64 = (1 << 64) - 1


def _s64(c: int) -> int:  # an unsigned 64-bit constant as the signed int64 torch stores
    return c - (1 << 64) if c >= 1 << 63 else c


_G, _M1, _M2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors; `>>` is arithmetic, so mask to get logical shifts."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _M1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def mix_py(z: int) -> int:
    """The same finaliser on Python ints (reference for tests, and for row keys)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_key(seed: int, index: int) -> int:
    """A 64-bit key (as signed int64) for trajectory `index` of a run seeded with `seed`."""
    return _s64(mix_py(mix_py(seed * 0x9E3779B97F4A7C15 + 1) + index))


def uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B,) float32 in [0, 1) from (B,) int64 keys and (B,) int64 positions; 24 random bits."""
    z = _mix(keys + (positions + 1) * _G)
    return ((z >> 40) & 0xFFFFFF).float() * (1.0 / (1 << 24))


# -----------------------------------------------------------------------------
# sampling


@dataclass(frozen=True)
class SamplingParams:
    """How a run samples (config.SamplingConfig's fields, or greedy); hashable: a CUDA graph of the
    decode step is captured per value."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    @classmethod
    def of(cls, cfg, greedy: bool = False) -> "SamplingParams":
        if greedy or cfg.temperature <= 0:  # one greedy mode, whatever the other fields say
            return cls(greedy=True)
        return cls(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k))


PREFILTER = 128  # top-p ranks only each row's PREFILTER most likely tokens (a partial sort);
# a row whose nucleus is wider than that (a flat distribution) is ranked by a full sort instead


def sample_next(logits, keys, positions, *, temperature=1.0, top_p=1.0, top_k=0, greedy=False):
    """Sample one token per row. logits (B, V); keys, positions (B,) int64.

    Returns tokens (B,) long and their logprobs (B,) fp32 under softmax(logits / temperature),
    the distribution the trainer recomputes. With top_p = 1 and top_k = 0 that is exactly the
    distribution sampled from; with truncation the sampled distribution is this one renormalised
    over the kept tokens. Greedy returns the argmax and its temperature-1 logprob.

    sample_on_device below, then the rows it could not settle sampled exactly (exact_rows: a full
    sort); finding them is one host read (free on a CPU; on CUDA a sync). The decode step, which
    runs inside a CUDA graph, calls sample_on_device alone and leaves those rows to the host.
    """
    tok, logp, exact = sample_on_device(logits, keys, positions, temperature=temperature, top_p=top_p,
                                        top_k=top_k, greedy=greedy)
    if exact is not None and not bool(exact.all()):  # the host read
        rows = (~exact).nonzero().squeeze(-1)
        tok[rows], logp[rows] = exact_rows(logits[rows], keys[rows], positions[rows], temperature, top_p)
    return tok, logp


def sample_on_device(logits, keys, positions, *, temperature=1.0, top_p=1.0, top_k=0, greedy=False):
    """sample_next without a host read: (tokens (B,), logprobs (B,), exact (B,) bool or None).

    Rows where exact is False hold no valid sample: their top-p nucleus is wider than the
    PREFILTER tokens ranked here (or its edge is tied with a token left out), and only a full
    sort settles them (exact_rows). None: every row is exact (no top-p ranking was needed).

    The kept tokens are ranked by probability and u picks by inverse CDF in that order. Top-p
    never sorts the whole vocabulary: it ranks the top PREFILTER tokens (torch.topk) and, when
    their mass reaches top_p (the nucleus closes inside them, the common case), the prefix, its
    cumulative sums and so the token are those a full sort gives. Equal logits rank by ascending
    token id (a stable sort: an unstable one left their order to the implementation, so a tie
    could pick another of the equally likely tokens than before).
    """
    logits = logits.float()
    if greedy or temperature <= 0:
        tok = logits.argmax(-1)  # (B,) first index on ties, as HF greedy
        logp = logits.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        return tok, logp, None
    scaled = logits if temperature == 1.0 else logits / temperature  # (B, V)
    u = uniforms(keys, positions)[:, None]  # (B, 1)
    V = scaled.shape[-1]
    if 0 < top_k < V:
        ranked, idx = scaled.topk(top_k, -1)  # (B, K) sorted descending
        probs = ranked.softmax(-1)  # renormalised over the top k
        j = _inverse_cdf(_top_p_keep(probs, top_p), u, truncated=False)
        # logprob under the full temperature distribution, not the top-k one
        logp = probs.gather(-1, j).log().squeeze(-1) + torch.logsumexp(ranked, -1) - torch.logsumexp(scaled, -1)
        return idx.gather(-1, j).squeeze(-1), logp, None
    if top_p >= 1.0:  # the whole distribution in vocabulary order: no ranking at all
        probs = scaled.softmax(-1)
        j = _inverse_cdf(probs, u, truncated=False)
        return j.squeeze(-1), probs.gather(-1, j).log().squeeze(-1), None
    if PREFILTER >= V:
        tok, logp = _sorted_top_p(scaled, u, top_p)
        return tok, logp, None
    probs = scaled.softmax(-1)  # (B, V)
    values, head = scaled.topk(PREFILTER + 1, -1)  # (B, P + 1) descending, equal logits in no set order
    last, after = values[:, PREFILTER - 1:].unbind(-1)
    idx = _by_logit(scaled, head[:, :PREFILTER])  # (B, P) ranked as the full sort ranks them
    ranked = probs.gather(-1, idx)  # (B, P) descending
    keep = _top_p_keep(ranked, top_p)
    j = _inverse_cdf(keep, u, truncated=True)  # (B, 1)
    tok, logp = idx.gather(-1, j).squeeze(-1), ranked.gather(-1, j).log().squeeze(-1)
    # (B,) the nucleus closes inside the top P, and the P-th logit is not tied with one left out
    exact = (ranked.cumsum(-1)[:, -1] >= top_p) & (last != after)
    return tok, logp, exact


def exact_rows(logits, keys, positions, temperature: float, top_p: float):
    """Top-p by a full sort for the rows sample_on_device left unsettled: logits (R, V), keys and
    positions (R,) -> tokens (R,), logprobs (R,) (the same uniform as every other path)."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    return _sorted_top_p(scaled, uniforms(keys, positions)[:, None], top_p)


def _top_p_keep(probs, top_p):
    """probs (B, K) sorted descending -> the smallest prefix whose mass reaches top_p (>= 1 token),
    other entries zeroed."""
    if top_p >= 1.0:
        return probs
    return probs * ((probs.cumsum(-1) - probs) < top_p)


def _inverse_cdf(keep, u, truncated: bool):
    """Index (B, 1) into keep (B, K) whose cumulative mass first exceeds u (B, 1) of the total.

    u * total can round up to total (p ~ 2^-24): then take the token at half the mass instead.
    truncated: keep is the head of a longer ranking whose remaining entries are all zero, so an
    index past its end stands for one of those zeros (the half-mass case) as it would in full."""
    cdf = keep.cumsum(-1)  # (B, K)
    total = cdf[:, -1:]
    j = torch.searchsorted(cdf, u * total, right=True)
    past_end = j >= cdf.shape[-1]
    j = j.clamp_(max=cdf.shape[-1] - 1)
    usable = keep.gather(-1, j) > 0
    if truncated:
        usable &= ~past_end
    return torch.where(usable, j, torch.searchsorted(cdf, 0.5 * total, right=True))


def _by_logit(scaled, idx):
    """idx (B, K) reordered by descending logit, equal logits by ascending token id (a stable
    sort's order, so a rank never depends on the sort's implementation)."""
    idx = idx.sort(-1).values
    return idx.gather(-1, scaled.gather(-1, idx).sort(dim=-1, descending=True, stable=True).indices)


def _sorted_top_p(scaled, u, top_p):
    """Top-p over a full sort of scaled (B, V): the reference the prefilter reproduces."""
    ranked, idx = scaled.sort(dim=-1, descending=True, stable=True)
    probs = ranked.softmax(-1)
    j = _inverse_cdf(_top_p_keep(probs, top_p), u, truncated=False)
    return idx.gather(-1, j).squeeze(-1), probs.gather(-1, j).log().squeeze(-1)


# -----------------------------------------------------------------------------
# stop strings


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer, vocab_size: int) -> list[bytes] | None:
    """Bytes of every token id (byte-level BPE, specials as their text), or None if the
    tokenizer is not byte-level (then StopChecker decodes a tail window with the tokenizer)."""
    dec = _byte_decoder()
    special = {t.content if hasattr(t, "content") else str(t): True
               for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    toks = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    table = []
    for t in toks:
        if t is None:
            table.append(b"")
        elif t in special:
            table.append(t.encode())
        elif all(c in dec for c in t):
            table.append(bytes(dec[c] for c in t))
        else:
            return None
    table += [b""] * (vocab_size - len(table))
    probe = "SELECT a FROM t WHERE x = 'é';</sql> 12\n<solution>"
    ids = tokenizer.encode(probe, add_special_tokens=False)
    if b"".join(table[i] for i in ids).decode("utf-8", "replace") != tokenizer.decode(ids):
        return None
    return table


class StopChecker:
    """Detects EOS and stop strings at the end of a turn's sampled ids, incrementally.

    check() is called after every sampled token and looks only at the last `window` tokens
    (a stop string of L bytes spans at most L tokens), and only when the new token contains the
    last byte of some stop string, so a step costs a set lookup for most rows.
    """

    def __init__(self, tokenizer, stop_strings, eos_ids=(), vocab_size: int = 0):
        self.eos = set(int(i) for i in eos_ids if i is not None)
        self.stops = [s.encode() for s in stop_strings if s]
        self.window = max([len(s) for s in self.stops], default=0) + 1
        self.tokenizer = tokenizer
        self.table, self.cand = None, set()
        if self.stops:
            vocab_size = max(vocab_size, len(tokenizer))
            self.table = token_bytes(tokenizer, vocab_size)
            if self.table is not None:
                last = {s[-1:] for s in self.stops}
                self.cand = {i for i, b in enumerate(self.table) if any(x in b for x in last)}

    def check(self, ids: list[int], start: int = 0) -> str | None:
        """ids: the trajectory so far; start: where the current turn began (stops never span turns)."""
        t = ids[-1]
        if t in self.eos:
            return "eos"
        if not self.stops:
            return None
        if self.table is not None:
            if t not in self.cand:
                return None
            tail = b"".join(self.table[i] for i in ids[max(start, len(ids) - self.window):])
        else:
            tail = self.tokenizer.decode(ids[max(start, len(ids) - self.window):]).encode()
        return "stop" if any(s in tail for s in self.stops) else None

    def candidates(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool: the tokens after which check() can answer eos or stop. The engine
        looks the sampled tokens up on the device and calls check() only for those rows.

        A stop string found by check() ends inside the newest token (an earlier end would have
        been found one token earlier), so a token is a candidate iff it contains a stop string
        or begins with one's proper suffix, e.g. for </sql>: ">", "l>", "ql> ...", "x</sql>y"."""
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        for i in self.eos:
            if 0 <= i < vocab_size:
                mask[i] = True
        if not self.stops:
            return mask
        if self.table is None:  # no byte table: every token may complete one (check() decodes)
            return torch.ones(vocab_size, dtype=torch.bool)
        for i, piece in enumerate(self.table[:vocab_size]):
            if i in self.cand and any(stop in piece or any(piece.startswith(stop[-k:]) for k in range(1, len(stop)))
                                      for stop in self.stops):
                mask[i] = True
        return mask
