"""One engine configuration type with one set of defaults: ``conf/engine/<device>.yaml``, composed by
Hydra for runs and read by ``harness.config.engine_settings`` for the throughput bench, batch_run
and the engine tests (no engine started)."""
from __future__ import annotations

from dataclasses import asdict, replace

import pytest
from hydra import compose, initialize_config_dir

from harness.config import DEVICE_CONFIGS, ConfigError, engine_defaults, engine_settings, typed
from harness.engine.batch_run import check_spec
from tests.support import ROOT


def hydra_engine(group: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return typed(compose("config", overrides=[f"engine={group}"])).engine


@pytest.mark.parametrize("device, group", sorted(DEVICE_CONFIGS.items()))
def test_hydra_runs_and_engine_settings_start_the_same_engine(device, group):
    assert engine_settings(device) == hydra_engine(group)
    assert engine_defaults(device)["device"] == device


def test_every_conf_engine_file_is_one_devices_defaults():
    assert sorted(DEVICE_CONFIGS.values()) == sorted(p.stem for p in (ROOT / "conf" / "engine").glob("*.yaml"))


def test_overrides_change_only_the_fields_they_name():
    cpu = engine_settings()
    assert cpu == engine_settings("cpu") and cpu.kv_cache_gib == 2.0, "the engine tests' pool: cpu.yaml's"
    changed = engine_settings("cpu", num_kv_blocks=30, layer_groups=3)
    assert (changed.num_kv_blocks, changed.layer_groups) == (30, 3)
    assert replace(changed, num_kv_blocks=None, layer_groups=1) == cpu
    gpu = engine_settings("cuda", in_process=True)
    assert (gpu.block_size, gpu.in_process, gpu.gpu_memory_utilization) == (16, True, 0.9)


def test_an_unknown_setting_or_device_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^unknown engine setting\(s\) kv_blocks; valid: .*num_kv_blocks") as error:
        engine_settings("cpu", kv_blocks=30)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"^unknown engine device 'tpu'; valid: cpu, cuda$"):
        engine_settings("tpu")


def test_a_batch_run_spec_carries_the_engine_under_its_field_names():
    assert check_spec({"prompts": [[1]]}) == engine_settings("cpu")
    assert check_spec({"engine": {"device": "cuda", "num_kv_blocks": 30}}) == engine_settings("cuda", num_kv_blocks=30)
    with pytest.raises(ValueError, match=r"^batch_run spec has unknown key\(s\) block_size, kv_blocks; valid: .*"
                                         r"the engine's settings go under 'engine'"):
        check_spec({"kv_blocks": 30, "block_size": 32})
    with pytest.raises(ConfigError, match=r"^unknown engine setting\(s\) kv_blocks"):
        check_spec({"engine": {"kv_blocks": 30}})


def test_the_engine_tests_pass_engine_fields_as_keywords(monkeypatch, tmp_path):
    """``run_engine(..., num_kv_blocks=30)`` puts the engine's fields in the spec's engine record
    and leaves batch_run's own keys beside it."""
    from tests.support import engine_support

    sent = {}
    monkeypatch.setattr(engine_support, "model_path", lambda model: "/m")
    monkeypatch.setattr(engine_support, "run_in_subprocess", lambda spec, *_, **__: sent.update(spec) or {})
    monkeypatch.setattr("tests.support.engine_pool._pool", None)  # whatever an engine file left: a process of its own
    engine_support.run_engine(tmp_path, "tiny", [[1, 2]], 4, num_kv_blocks=30, max_model_len=900, prefix_caching=True)
    assert sent["engine"] == asdict(engine_settings("cpu", num_kv_blocks=30))
    assert (sent["max_model_len"], sent["prefix_caching"], sent["top_logprobs"]) == (900, True, 3)
    assert "num_kv_blocks" not in sent and check_spec(sent) == engine_settings("cpu", num_kv_blocks=30)
    assert engine_support.BLOCK == engine_settings("cpu").block_size == 32
