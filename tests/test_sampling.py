"""engine/sampling.py against references: top-p without a full sort picks the tokens a full sort picks,
and the device's turn-end candidates miss no stop string.

    .venv/bin/pytest tests/test_sampling.py -q
"""
import random

import pytest
import torch

from engine import sampling
from toy import tiny
from engine.sampling import StopChecker, row_key, sample_next

STOPS = ["</sql>", "</solution>"]


# -----------------------------------------------------------------------------
# top-p: the prefiltered ranking against a full sort


def sorted_reference(logits, keys, positions, temperature, top_p, stable=True):
    """Top-p as it was written before the prefilter: sort the whole vocabulary, keep the
    smallest prefix reaching top_p, inverse CDF in that order. The sort is stable: the old code's
    unstable sort left the order of equal logits to the implementation."""
    scaled = logits.float() / temperature
    u = sampling.uniforms(keys, positions)[:, None]
    ranked, idx = scaled.sort(dim=-1, descending=True, stable=stable)
    probs = ranked.softmax(-1)
    keep = probs * ((probs.cumsum(-1) - probs) < top_p)
    cdf = keep.cumsum(-1)
    total = cdf[:, -1:]
    j = torch.searchsorted(cdf, u * total, right=True).clamp_(max=cdf.shape[-1] - 1)
    j = torch.where(keep.gather(-1, j) > 0, j, torch.searchsorted(cdf, 0.5 * total, right=True))
    return idx.gather(-1, j).squeeze(-1), probs.gather(-1, j).log().squeeze(-1)


def logit_rows(n, vocab, seed):
    """Rows from peaked (nucleus of a few tokens) to flat (nucleus far past the prefilter), some
    with -inf entries and repeated values."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.5, n)[:, None]  # (n, 1): spread of the logits per row
    logits = torch.randn(n, vocab, generator=gen) * scale
    logits[::7, vocab // 2:] = float("-inf")  # a banned half
    logits[::5, :40] = logits[::5, :1]  # ties at the top
    return logits


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.95), (0.6, 0.9), (0.9, 0.5)])
def test_prefiltered_top_p_picks_the_full_sorts_tokens(temperature, top_p):
    n, vocab = 3000, 1000
    logits = logit_rows(n, vocab, seed=int(temperature * 10))
    keys = torch.tensor([row_key(4, i) for i in range(n)])
    positions = torch.arange(n) % 97
    tok, logp = sample_next(logits, keys, positions, temperature=temperature, top_p=top_p)
    want_tok, want_logp = sorted_reference(logits, keys, positions, temperature, top_p)
    assert torch.equal(tok, want_tok)
    assert torch.allclose(logp, want_logp, atol=1e-6, rtol=0)
    # against the unstable sort used before: a different token only among equally likely ones
    old_tok, _ = sorted_reference(logits, keys, positions, temperature, top_p, stable=False)
    differ = tok != old_tok
    assert torch.equal(logits[differ].gather(-1, tok[differ, None]), logits[differ].gather(-1, old_tok[differ, None]))
    # both regimes occur: nuclei inside the prefilter and wider ones (the full-sort fallback)
    probs = torch.softmax(logits / temperature, -1).sort(-1, descending=True).values
    width = ((probs.cumsum(-1) - probs) < top_p).sum(-1)
    assert (width <= sampling.PREFILTER).sum() > n // 4 and (width > sampling.PREFILTER).sum() > n // 10


def test_a_search_past_the_nucleus_takes_the_half_mass_token_as_a_full_sort_does():
    """The guard for u * total reaching total (u = 1 here; rounding could in principle get there):
    the full ranking's search lands on a zero past the nucleus and takes the half-mass token; the
    prefiltered head, whose nucleus ends exactly at its last entry, must not take that entry."""
    head = torch.tensor([[0.3, 0.3, 0.35]])  # cdf 0.3, 0.6, 0.95: half the mass lies in entry 1
    full = torch.cat([head, torch.zeros(1, 5)], 1)
    u = torch.ones(1, 1)
    want = sampling._inverse_cdf(full, u, truncated=False)
    assert int(want) == 1  # the half-mass token, not the last one
    assert int(sampling._inverse_cdf(head, u, truncated=True)) == int(want)


# -----------------------------------------------------------------------------
# turn-end candidates on the device


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny.build_tiny_tokenizer(d, vocab_size=512)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(d)


def test_every_turn_end_is_a_candidate_and_few_tokens_are(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    stop = StopChecker(tok, STOPS, eos_ids=[eos])
    mask = stop.candidates(len(tok))
    assert mask[eos] and mask.sum() < len(tok) // 10, int(mask.sum())
    # random token streams: noise, then a stop string cut at random places (each piece tokenized
    # on its own), some of them broken off early: every turn end check() finds is at a candidate
    noise = tok.encode(" x > y ql> l>> </s </so lution")
    rng = random.Random(0)
    ends = 0
    for _ in range(2000):
        stop_text = rng.choice(STOPS)
        cuts = sorted(rng.sample(range(1, len(stop_text)), rng.randint(0, 3)))
        parts = [stop_text[i:j] for i, j in zip([0] + cuts, cuts + [len(stop_text)])]
        if rng.random() < 0.2:
            parts = parts[:-1]
        ids = [rng.choice(noise) for _ in range(rng.randint(0, 4))] + [i for p in parts for i in tok.encode(p)]
        for i in range(1, len(ids) + 1):
            if stop.check(ids[:i]) is not None:
                assert mask[ids[i - 1]], tok.decode(ids[:i])
                ends += 1
                break
    assert ends > 1000
    assert stop.candidates(len(tok) + 8).shape == (len(tok) + 8,)  # a model vocab past the tokenizer's
