"""Teacher forcing inside vLLM: a request that carries ``extra_args["forced_tokens"]`` emits exactly
those tokens, one per step, while its reported log-probabilities stay the model's own.

Why it is exact: with ``logprobs_mode="raw_logprobs"`` (vLLM's default) the sampler computes the
log-probabilities it reports from the model's logits *before* any logits processor runs
(vllm/v1/sample/sampler.py:86-89), then applies the non-argmax-invariant processors, this one among
them (sampler.py:99, 403-404), and samples greedily from what they left (sampler.py:103). The
processors edit the float32 logits in place, never the log-probabilities computed before them. So the
forced token is the one sampled and appended to the sequence (its KV is written, eviction sees it
as a generated token), while the returned ``Logprob`` of that token, and its rank, are the raw
model's (sampler.py:127-131, ``gather_logprobs`` with ``token_ids=sampled``). Eviction runs exactly
as in generation: prefill eviction after the prompt, decode evictions as the forced tokens grow the
cache.

Registered on every harness engine (``Engine``: ``logits_processors``); a request without the key
is untouched and costs one dictionary check per step.
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCED_KEY = "forced_tokens"
PROCESSOR = "harness.engine.forced_decoding:ForcedTokens"  # vLLM loads it by this name (<module>:<class>)


class ForcedTokens(LogitsProcessor):
    """Per batch row, the tokens it must emit and its live output list (vLLM hands processors a
    reference to it: ``BatchUpdate`` in vllm/v1/sample/logits_processor/interface.py:44-48), so the
    next forced token is the one at ``len(output)``."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        forced = (sampling_params.extra_args or {}).get(FORCED_KEY)
        if forced is None:
            return
        if not forced or not all(isinstance(token, int) and token >= 0 for token in forced):
            raise ValueError(f"extra_args[{FORCED_KEY!r}] must be a non-empty list of token ids, got {forced!r}")
        if sampling_params.max_tokens != len(forced):
            raise ValueError(f"a forced request must ask for exactly its {len(forced)} forced tokens "
                             f"(max_tokens={sampling_params.max_tokens})")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: vLLM must run it before greedy sampling

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def forced_row(params, _prompt_ids, output_ids):
            forced = (params.extra_args or {}).get(FORCED_KEY) if params is not None else None
            return (list(forced), output_ids) if forced else None

        process_dict_updates(self.rows, batch_update, forced_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (forced, output) in self.rows.items():
            step = len(output)
            if step < len(forced):
                logits[row].fill_(float("-inf"))
                logits[row, forced[step]] = 0.0
        return logits
