"""The only package that knows vLLM: ``Engine`` builds a (patched) vLLM engine; ``harness.run.group``
drives it for cells through ``shared_prefill.generate_shared``."""
from harness.engine.llm import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
