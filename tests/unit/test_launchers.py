"""Scale-out through Hydra's launchers: the shipped Slurm and joblib configs compose and instantiate."""
from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from tests.support import ROOT


def hydra_launcher(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"hydra/launcher={name}", *overrides],
                       return_hydra_config=True).hydra.launcher


def test_slurm_launcher_instantiates_without_submitting():
    config = hydra_launcher("slurm_gpu")
    assert config.parameters.gpus_per_node == 1 and config.parameters.timeout_min == 240
    launcher = instantiate(config)
    assert type(launcher).__name__ == "ClusterGroupLauncher"
    assert launcher.settings["cluster"] == "slurm" and launcher.settings["retries"] == 1
    # the README's command line names a partition without a "+"
    assert hydra_launcher("slurm_gpu", "hydra.launcher.parameters.slurm_partition=gpu").parameters.slurm_partition == "gpu"


def test_the_local_cluster_launcher_is_the_slurm_one_on_this_machine():
    config = hydra_launcher("slurm_local")
    assert (config.cluster, config.parallelism, config.parameters.gpus_per_node) == ("local", 1, 0)
    assert config.parameters.cpus_per_task == 8, "the rest comes from slurm_gpu"


def test_a_cluster_launcher_refuses_an_unknown_cluster_before_submitting():
    import pytest

    from harness.run.cluster import ClusterSettings, executor_for

    with pytest.raises(ValueError, match="cluster='kubernetes'; valid: slurm, local"):
        executor_for(ClusterSettings(cluster="kubernetes"))
    with pytest.raises(ValueError, match="parallelism must be at least 1"):
        executor_for(ClusterSettings(cluster="local", parallelism=0))


def test_joblib_launcher_instantiates():
    launcher = instantiate(hydra_launcher("local_parallel"))
    assert type(launcher).__name__ == "JoblibLauncher"
