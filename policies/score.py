"""What a score is: how important each cached token is, and what computing it needs.

A score is called with one layer's K/V of one request, ``[tokens, kv_heads, head_dim]`` tensors
(keys post-RoPE, as cached), and returns ``[kv_heads, tokens]`` float32 scores, higher = keep. A
head's row reads only that head's keys, values and query group: under tensor parallelism each
rank scores its own heads (a choice across heads is the selection's, ``share``). It
declares what the engine must give it and may keep for it:

* ``static``: a token's score is fixed once its K/V is written (||V||/||K||, ||K||): the engine
  keeps scores per request and scores only the tokens written since the last eviction;
* ``query_window`` W > 0: it also gets a ``Window``, the queries of the request's newest W tokens
  in that layer (``policies.attention``), and reads attention; a score whose W is its ``window``
  option derives from ``policies.attention.WindowScore``, which owns the option and its check;
* ``accumulates``: its scores add up over the request's queries (H2O): the engine counts every
  query once and keeps the totals, which follow their tokens through compaction and block drops;
* ``reconstructs``: its scores come from extra forward passes the engine runs over the request's
  cache just before the prefill eviction (KVzip's reconstruction of the context): they are left in
  the request's state, and the evictor reads them there instead of calling the score on K/V.

What the engine then does with the scores (which tokens or block stay) is the selection's
(``policies.selection``); a score may fix part of it where its rule says so (``token_edges``: SnapKV
keeps its window, H2O its recent tokens; ``share``: TOVA chooses per layer).

An attention-free score without options is one function; ``policies.registry.register_score``
makes it a ``Score`` and a policy at either granularity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

import torch

Share = Literal["head", "layer", "request"]


@dataclass
class Score:
    static: ClassVar[bool] = False
    accumulates: ClassVar[bool] = False
    reconstructs: ClassVar[bool] = False  # scored by reconstruction passes (``policies.kvzip``)
    # The selection sharing this score's rule imposes (None: the selection's ``per_head`` option).
    share: ClassVar[Share | None] = None

    @property
    def query_window(self) -> int:
        """How many of a request's newest queries the engine must keep for this score (0: none)."""
        return 0

    @property
    def reads_values(self) -> bool:
        """Whether ``__call__`` reads the values: an attention score (``query_window`` > 0) reads
        keys and queries only, and is then called with ``values=None`` (the engine skips gathering
        them: half of an attention-aware eviction's reads). A score that needs both says so."""
        return self.query_window == 0

    def __call__(self, keys: torch.Tensor, values: torch.Tensor | None, window=None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} computes no score")

    def token_edges(self, budget: int, block_size: int) -> tuple[int, int] | None:
        """The (first, last) tokens a token selection always keeps under this score's rule, or None
        for the selection's own (``protect_edges``)."""
        return None

    def newest_kept(self) -> int:
        """How many of the newest tokens this score's rule keeps at any granularity (SnapKV: its
        window); a block selection keeps the blocks that hold them."""
        return 0

    def check(self, budget: int, block_size: int, granularity: str) -> None:
        """Refuse options that cannot work with this budget, block size and granularity."""

    def min_budget(self, block_size: int, granularity: str) -> int:
        """The smallest budget ``check`` accepts for these options (whole blocks, at least two)."""
        return 2 * block_size

    def accumulate(self, kept: torch.Tensor | None, counted: torch.Tensor, queries: int) -> torch.Tensor:
        """An accumulating score's new state: ``kept`` ``[layers, heads, t]`` (None at first) is
        the state of the request's first t tokens, ``counted`` ``[layers, heads, tokens]`` this
        score of the ``queries`` newest queries not yet counted. By default they add up (H2O)."""
        if kept is not None:
            counted[..., : kept.shape[-1]] += kept
        return counted


def function_score(name: str, function: Callable, static: bool) -> type[Score]:
    """A ``Score`` class around an attention-free ``function(keys, values) -> [heads, tokens]``."""

    def call(self, keys, values, window=None):
        return function(keys, values)

    cls = type(function.__name__, (Score,), {"__call__": call, "static": static, "__doc__": function.__doc__,
                                             "__module__": function.__module__})
    return dataclass(cls)
