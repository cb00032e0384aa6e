"""Scale-out through Hydra's launchers: the shipped Slurm and joblib configs compose and instantiate."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

ROOT = Path(__file__).resolve().parents[1]


def hydra_launcher(name: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"hydra/launcher={name}"], return_hydra_config=True).hydra.launcher


def test_slurm_launcher_instantiates_without_submitting():
    config = hydra_launcher("slurm_gpu")
    assert config.gpus_per_node == 1 and config.timeout_min == 240
    launcher = instantiate(config)
    assert type(launcher).__name__ == "SlurmLauncher"


def test_joblib_launcher_instantiates():
    launcher = instantiate(hydra_launcher("local_parallel"))
    assert type(launcher).__name__ == "JoblibLauncher"
