"""Learned: a small scorer, trained to predict the attention a token will receive from its K/V alone.

Five features of each token per KV head, all fixed once the token is written: log||K||, log||V||,
their squares and their product; the score is a weighted sum of them, one weight vector for every
layer and head. ||V||/||K|| is the special case (1, -1 on log||V||, log||K||, the rest 0) of the
same family, so what training adds is measured against PagedEviction's score exactly. The weights
(``learned_scorer.json`` beside this file) were fitted by ``experiments/train_scorer.py`` to the
log attention mass the prompt's last 32 queries pay each token (the label of the proxy study), on
prompts of the scorer's own text generator (``experiments/scorer_text.py``: village notes,
letters, a diary, a storeroom account, a Python module; 1.1k-7.5k tokens), whose templates and word
lists no evaluation uses: the script refuses to train if one of its sentences (4+ words) or answers
occurs in any evaluation family's text (``tests/unit/test_scorer_text.py`` checks the same). The
file records the command, the data and the rank correlation on held-out generated prompts and on
embedded-suite prompts (seed 0, measured only). Static, like ||V||/||K||: no query capture, scores
kept per request.
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from policies.base import l2
from policies.registry import register_score

WEIGHTS = Path(__file__).with_name("learned_scorer.json")
FEATURES = ("log_key_norm", "log_value_norm", "log_key_norm^2", "log_value_norm^2", "log_key_norm*log_value_norm")
EPS = 1e-6


def features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[heads, tokens, 5]`` features of one layer's ``[tokens, heads, dim]`` K/V."""
    log_key, log_value = torch.log(l2(keys).T + EPS), torch.log(l2(values).T + EPS)
    return torch.stack([log_key, log_value, log_key**2, log_value**2, log_key * log_value], dim=-1)


@cache
def trained_weights() -> torch.Tensor:
    fitted = json.loads(WEIGHTS.read_text())
    if tuple(fitted["features"]) != FEATURES:
        raise ValueError(f"{WEIGHTS} was fitted on features {fitted['features']}, not {list(FEATURES)}")
    return torch.tensor(fitted["weights"], dtype=torch.float32)


@register_score("learned", granularity="token", static=True)
def learned(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The trained K/V scorer's prediction of log attention mass: ``[heads, tokens]``."""
    weights = trained_weights().to(keys.device)
    return features(keys, values) @ weights
