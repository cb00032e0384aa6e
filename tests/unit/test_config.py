"""Config composition and the bad-input paths: every error is one clear line, before any model loads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.config import ConfigError, run_settings
from tests.support import ROOT


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def experiment_cells(experiment: str) -> list[list[str]]:
    """Every cell's overrides of ``run.py -m +experiment=<experiment>``: its config's sweep parameters
    expanded as the sweep itself expands and checks them (``harness.run.sweep.SweepProgress``)."""
    from harness.run.sweep import sweep_cells

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = compose("config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    return sweep_cells(config, [f"+experiment={experiment}"])


def test_default_config_composes():
    cfg = compose_cfg()
    assert (cfg.policy.name, cfg.model.name, cfg.data.name, cfg.engine.device) == ("full", "smollm2-135m", "synthetic", "cpu")
    assert cfg.block_size == 32 and cfg.budget == 1024
    run_settings(cfg)


@pytest.mark.parametrize("policy", ["full", "paged", "streaming", "knorm", "keydiff"])
@pytest.mark.parametrize("budget", [256, 512, 1024])
def test_every_policy_and_budget_validates(policy, budget):
    run_settings(compose_cfg(f"policy={policy}", f"budget={budget}"))


def test_a_ratio_on_the_command_line_wins_over_the_default_budget():
    # The default budget gives way to a ratio; only a budget written beside it is refused (above).
    run = run_settings(compose_cfg("policy=knorm", "budget_ratio=0.5"))
    assert (run.budget, run.budget_ratio, run.label) == (None, 0.5, "knorm budget_ratio=0.5")


def test_context_compression_evicts_once_at_the_context_by_default():
    run = run_settings(compose_cfg("policy=snapkv", "budget_ratio=0.5", "compress=context"))
    assert (run.decode_eviction, run.compress, run.label) == (False, "context", "snapkv budget_ratio=0.5 context only")
    assert run.eviction.compress == "context" and run.cell_name.startswith("snapkv_r0.5_context_bs32_")
    prompt_only = run_settings(compose_cfg("policy=snapkv", "budget_ratio=0.5", "decode_eviction=false"))
    assert prompt_only.cell_name != run.cell_name and "compress" not in prompt_only.identity()
    assert run_settings(compose_cfg()).decode_eviction is True


def test_gpu_engine_defaults_to_the_papers_block_size():
    cfg = compose_cfg("engine=gpu", "model=llama-3.2-1b")
    assert cfg.block_size == 16 and cfg.model.path == "meta-llama/Llama-3.2-1B-Instruct"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy=paged", "budget=80"], "not a multiple of block_size=32"),
        (["policy=paged", "budget=32"], "below two blocks"),
        (["policy=paged", "budget=16384"], "above model smollm2-135m's context of 8192"),
        (["block_size=16"], "cannot be used on cpu"),
        (["data.limit=0"], "data.limit must be a positive integer"),
        (["data=jsonl", "data.path=/no/such/file.jsonl"], "does not exist"),
        (["data.tasks=[single_doc_qa,nope]"], "unknown task(s) nope"),
        (["model.path=/no/such/model"], "does not exist"),
        (["policy=streaming", "+policy.options.n_sinks=2"], "no option n_sinks"),
        (["policy.name=oracle"], "valid: full, h2o, hybrid, keydiff, keydiff_block"),
        (["engine.kv_cache_gib=0.1"], "(72 blocks of 32 tokens) holds 72 blocks, each of the model's 30 layers, but one "
                                      "request of model smollm2-135m may need max_model_len=8192 tokens (256 blocks; and "
                                      "vLLM keeps one block back): raise engine.kv_cache_gib to at least 0.353"),
        (["engine.num_kv_blocks=256"], "engine.num_kv_blocks=256 (of 32 tokens) holds 256 blocks, each of the model's 30 "
                                       "layers, but one request of model smollm2-135m may need max_model_len=8192 tokens "
                                       "(256 blocks; and vLLM keeps one block back): raise engine.num_kv_blocks to at least 257"),
        (["policy=full", "budget=-5"], "budget=-5 is below two blocks"),
        (["policy=full", "budget=1000000"], "budget=1000000 is above model smollm2-135m's context"),
        (["engine=gpu", "model=tiny"], "model.dtype=float32 cannot run on the GPU engine"),
        (["engine.tensor_parallel_size=0"], "engine.tensor_parallel_size=0 must be a positive integer"),
        (["engine.tensor_parallel_size=2"], "engine.tensor_parallel_size=2 must divide model smollm2-135m's 9 query "
                                            "and 3 KV heads"),
        (["model=tiny", f"engine.tensor_parallel_size={len(os.sched_getaffinity(0)) + 2}"], "needs a core per rank"),
        (["engine.distributed_executor_backend=dask"], "engine.distributed_executor_backend='dask'; valid: null"),
        (["engine.distributed_executor_backend=ray"], "vLLM's Ray executor does not support the CPU platform"),
        (["policy=snapkv", "budget=512", "budget_ratio=0.5"], "budget_ratio=0.5 sets each request's budget from its "
                                                              "prompt: pass budget=null with it (budget=512 was also given)"),
        (["policy=snapkv", "compress=question"], "compress must be one of prompt, context"),
        (["policy=snapkv", "budget=null", "budget_ratio=0.5", "compress=context", "decode_eviction=true"],
         "compress=context compresses the context once, before the question (kvpress's query-agnostic setting); pass "
         "decode_eviction=false with it"),
        (["policy=snapkv", "budget=null", "budget_ratio=1.0"], "budget_ratio is the share of the prompt removed, "
                                                               "a number in [0, 1); got 1.0"),
        (["policy=snapkv", "budget=null"], "budget=null needs a budget_ratio"),
        (["policy=snapkv", "decode_eviction=maybe"], "decode_eviction must be true or false, got 'maybe'"),
    ],
)
def test_bad_config_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        run_settings(compose_cfg(*overrides))
    assert message in str(error.value)


def test_tensor_parallelism_names_its_own_cells_and_one_worker_keeps_the_old_names():
    """``tensor_parallel_size`` joined the engine settings after cells were committed: at 1 a cell
    keeps its name, at 2 it is another cell."""
    one = run_settings(compose_cfg("model=tiny", "policy=paged", "budget=256"))
    assert "tensor_parallel_size" not in one.identity()["engine"] and one.engine.tensor_parallel_size == 1
    two = run_settings(compose_cfg("model=tiny", "policy=paged", "budget=256", "engine.tensor_parallel_size=2"))
    assert two.engine.tensor_parallel_size == 2 and two.cell_name != one.cell_name


def test_a_compression_ratio_and_prompt_only_name_their_own_cells():
    ratio = run_settings(compose_cfg("policy=snapkv", "budget=null", "budget_ratio=0.5"))
    assert ratio.run_dir.name.startswith("snapkv_r0.5_bs32_") and ratio.label == "snapkv budget_ratio=0.5"
    assert ratio.eviction.as_dict() == {"policy": "snapkv", "budget": None, "options": ratio.options, "budget_ratio": 0.5}
    assert ratio.policy_budget == 4096, "checked at the largest budget a ratio gives (an 8192-token prompt)"
    prompt = run_settings(compose_cfg("policy=snapkv", "budget=256", "decode_eviction=false"))
    assert prompt.run_dir.name.startswith("snapkv_b256_prompt_bs32_") and prompt.label == "snapkv budget=256 prompt only"
    plain = run_settings(compose_cfg("policy=snapkv", "budget=256"))
    assert "budget_ratio" not in plain.identity() and "decode_eviction" not in plain.identity()


def test_full_cache_is_one_cell_whatever_the_budget():
    assert run_settings(compose_cfg("budget=256")).cell_name == run_settings(compose_cfg("budget=1024")).cell_name
    assert run_settings(compose_cfg("policy=paged", "budget=256")).cell_name != run_settings(compose_cfg("policy=paged", "budget=512")).cell_name
    assert run_settings(compose_cfg("policy=paged", "budget=256")).run_dir.name.startswith("paged_b256_bs32_")


def run_py(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), f"output_dir={tmp_path / 'runs'}", *overrides],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy=oracle"], "Could not find 'policy/oracle'"),
        pytest.param(["model=gpt5"], "Could not find 'model/gpt5'", marks=pytest.mark.slow),
        pytest.param(["data=squad"], "Could not find 'data/squad'", marks=pytest.mark.slow),
        pytest.param(["engine=tpu"], "Could not find 'engine/tpu'", marks=pytest.mark.slow),
        (["policy=paged", "budget=100"], "error: budget=100 is not a multiple of block_size=32"),
        pytest.param(["data=jsonl", "data.path=missing.jsonl"], "error: data.path missing.jsonl does not exist", marks=pytest.mark.slow),
        pytest.param(["engine.kv_cache_gib=0.05"], "error: the KV pool of engine.kv_cache_gib=0.05", marks=pytest.mark.slow),
    ],
)
def test_run_py_refuses_bad_input_without_leaving_a_run_directory(tmp_path, overrides, message):
    done = run_py(tmp_path, *overrides)
    assert done.returncode != 0
    assert message in done.stderr
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.rglob("*.json*")), "no run files on bad input"
    if "Could not find" in message:
        assert "Available options" in done.stderr


def test_sweep_time_left_counts_only_runs_still_to_compute(capsys):
    """Full cache at three budgets is one run: once it is done, the cells repeating it cost nothing,
    so the estimate covers the distinct runs left, not the cells left."""
    import time

    from harness.run.sweep import SweepProgress

    cells = [compose_cfg(f"policy={p}", f"budget={b}", "output_dir=/nonexistent")
             for p, b in (("full", 256), ("full", 512), ("paged", 256))]
    progress = SweepProgress()
    progress.total, progress.pending = 3, {str(run_settings(c).run_dir) for c in cells}
    assert len(progress.pending) == 2
    progress.job_started = progress.started = time.perf_counter() - 60
    progress.on_job_end(cells[0], job_return=None)
    assert progress.pending == {str(run_settings(cells[2]).run_dir)}, "the paged run is all that is left"
    assert "1/3 cells done (0 already complete) | elapsed 1m00s ~1m00s left" in capsys.readouterr().out


def test_a_single_run_prints_no_sweep_progress(capsys):
    from harness.run.sweep import SweepProgress

    progress = SweepProgress()
    progress.on_job_start(compose_cfg())
    progress.on_job_end(compose_cfg(), job_return=None)
    assert "[sweep]" not in capsys.readouterr().out


def test_every_ablation_cell_composes_and_validates():
    """+experiment=ablation: ten variants x two budgets, each a distinct run directory, and full
    cache once (its reference)."""
    from harness.run.sweep import expand_sweep

    variants = sorted(p.stem for p in (ROOT / "conf" / "ablation").glob("*.yaml"))
    assert len(variants) == 11 and "full" in variants
    cells = expand_sweep([f"+ablation={','.join(variants)}", "budget=256,512", "+experiment=ablation"])
    names = set()
    for overrides in cells:
        cfg = compose_cfg(*overrides)
        run_settings(cfg)
        names.add(run_settings(cfg).run_dir.name)
    assert len(names) == 21


def test_every_kvzip_schedule_cell_composes_validates_and_its_focus_is_one_of_them():
    """+experiment=kvzip_schedule (``harness.analysis.studies``): KVzip at four ratios, three layer
    groups, each at the uniform (pair-uniform) and the kvzip schedule: 8 distinct cells, each passing
    the checks a run makes before any model loads, and the study's focus (what every other variant is
    compared with) is the label of its uniform cells."""
    from omegaconf import OmegaConf

    from harness.analysis.labels import variant_label
    from harness.analysis.studies import STUDIES

    cells = [compose_cfg(*overrides) for overrides in experiment_cells("kvzip_schedule")]
    assert len({run_settings(cfg).run_dir.name for cfg in cells}) == 8
    labels = {variant_label(OmegaConf.to_container(cfg, resolve=True)) for cfg in cells}
    assert labels == {"kvzip[compress=context, layer_groups=3]",
                      "kvzip[compress=context, layer_groups=3, budget_schedule=kvzip]"}
    (study,) = [study for study in STUDIES if study.folder == "kvzip_schedule"]
    assert study.focus in labels and study.beside == ("results/ruler_context",)


def test_the_private_hydra_name_the_sweep_expansion_asks_still_exists():
    """``expand_sweep`` asks Hydra's own basic sweeper (a private name): its parameters as in
    Hydra 1.3.2, and a sweep expands to the cells in Hydra's order."""
    import inspect

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from harness.run.sweep import expand_sweep

    assert list(inspect.signature(BasicSweeper.split_arguments).parameters) == ["overrides", "max_batch_size"]
    assert expand_sweep(["policy=paged,knorm", "budget=256,512", "seed=1"]) == [
        ["policy=paged", "budget=256", "seed=1"], ["policy=paged", "budget=512", "seed=1"],
        ["policy=knorm", "budget=256", "seed=1"], ["policy=knorm", "budget=512", "seed=1"]]


def test_a_run_whose_eviction_state_cannot_fit_is_refused_before_any_weight_loads():
    """PagedEviction keeps one float per token per request; a hundred million concurrent requests'
    state cannot fit this machine's memory, and the refusal gives the numbers."""
    with pytest.raises(ConfigError, match=r"policy paged at budget=1024 needs [0-9.]+ GiB \(4\.1 KiB of policy state "
                                          r"per request x 100000000 requests .* GiB are available: lower engine.max_num_seqs"):
        run_settings(compose_cfg("policy=paged", "engine.max_num_seqs=100000000"))
    run_settings(compose_cfg("policy=paged"))  # the default batch fits


def test_every_committed_cell_keeps_its_name():
    """A cell's name is a digest of its resolved config: settings added since (tensor parallelism,
    the executor backend) must leave every committed cell's name as it was, or sweeps would rerun
    them and CI would compare against nothing."""
    from omegaconf import OmegaConf

    configs = sorted((ROOT / "results").rglob("config.yaml"))
    assert len(configs) >= 50
    for path in configs:
        run = run_settings(OmegaConf.load(path), checked=False)
        assert run.cell_name == path.parent.name, path


def test_the_pyramids_slope_is_a_run_setting_named_only_away_from_its_default():
    """``pyramid_beta`` reaches a run through the settings record alone (its Hydra form): the
    engine gets it, the cell is named by it only when it is not kvpress's 20, and a slope without
    the pyramid is refused in one line."""
    base = ("policy=paged", "budget=512", "engine.layer_groups=3", "budget_schedule=pyramid")
    default, steep = run_settings(compose_cfg(*base)), run_settings(compose_cfg(*base, "pyramid_beta=5"))
    assert (default.eviction.pyramid_beta, steep.eviction.pyramid_beta) == (20.0, 5)
    assert steep.eviction.as_dict()["pyramid_beta"] == 5 and "pyramid_beta" not in default.eviction.as_dict()
    assert "pyramid_beta" not in default.identity() and steep.identity()["pyramid_beta"] == 5
    assert steep.cell_name.startswith("paged_b512_pyramid_beta5_bs32_") and steep.label == "paged budget=512 pyramid beta=5"
    with pytest.raises(ConfigError, match="pyramid_beta shapes budget_schedule=pyramid; this one is uniform"):
        run_settings(compose_cfg("policy=paged", "budget=512", "pyramid_beta=5"))


def test_a_chain_is_a_run_setting_named_only_when_on_and_refused_without_context_compression():
    """``chain`` reaches a run through the settings record alone (its Hydra form): the engine gets it,
    the cell is named by it only when it is on (committed cells keep their names), and a chain without
    compress=context is refused in one line."""
    base = ("policy=paged", "budget=null", "budget_ratio=0.5", "compress=context")
    off, on = run_settings(compose_cfg(*base)), run_settings(compose_cfg(*base, "chain=true"))
    assert (off.eviction.chain, on.eviction.chain) == (False, True)
    assert on.eviction.as_dict()["chain"] is True and "chain" not in off.eviction.as_dict()
    assert "chain" not in off.identity() and on.identity()["chain"] is True
    assert on.cell_name.startswith("paged_r0.5_context_chain_bs32_") and on.cell_name != off.cell_name
    with pytest.raises(ConfigError, match="chain=true carries a turn's compressed context into the next turn; it needs "
                                          "compress=context"):
        run_settings(compose_cfg("policy=paged", "budget=512", "chain=true"))
    with pytest.raises(ConfigError, match="chain must be true or false"):
        run_settings(compose_cfg(*base, "chain=3"))
