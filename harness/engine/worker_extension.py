"""vLLM's worker-extension hook (``worker_extension_cls``, mixed into the worker class by
``vllm/v1/worker/worker_base.py:296-316``): lets the harness ask each worker, through
``LLM.collective_rpc``, whether it really runs the eviction it was configured with, and what its
own evictions cost (under tensor parallelism only rank 0's reports reach the scheduler)."""
from __future__ import annotations


class EvictionWorkerExtension:
    def kv_eviction_status(self) -> dict:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from harness.engine.patches import installed

        runner = self.model_runner
        state = runner.__dict__.get("_kv_eviction")
        return {
            "runner_patched": installed(GPUModelRunner, "sample_tokens"),
            "settings": state.settings.as_dict() if state is not None and state.settings is not None else None,
            "backend": state.backend if state is not None else None,
        }

    def kv_eviction_seconds(self, reset: bool = False) -> dict | None:
        """This rank's model, eviction and capture seconds over the steps that evicted, since the
        last reset; None when it has no eviction state."""
        state = self.model_runner.__dict__.get("_kv_eviction")
        if state is None:
            return None
        seconds = dict(state.seconds, rank=state.shards.rank)
        if reset:
            state.seconds = dict.fromkeys(state.seconds, 0.0)
        return seconds
