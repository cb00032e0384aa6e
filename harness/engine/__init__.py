"""The only package that knows vLLM. ``start_engine`` builds a (patched) vLLM engine from a config."""
from harness.engine.llm import Engine, GenerationResult, start_engine

__all__ = ["Engine", "GenerationResult", "start_engine"]
