"""The ``policy`` config group and the sweeps' policy lists, made from the policy registry (there is
no conf/policy/).

Hydra imports every module under ``hydra_plugins`` when it first looks for plugins, before it
composes a config (``hydra/core/plugins.py``, ``Plugins._scan_all_plugins``); storing the group
here gives ``run.py``, sweeps and ``hydra.compose`` alike one ``policy=<name>`` choice per
registered policy, its options at the code's defaults. ``${kv_policies:}`` in a sweep's
``hydra.sweeper.params`` is every registered policy but the aliases (the sweeper reads the params
through OmegaConf, so the resolver runs there).
"""
from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from policies import REGISTRY, default_options


def store_policy_configs() -> None:
    store = ConfigStore.instance()
    for name in REGISTRY:
        store.store(group="policy", name=name, node={"name": name, "options": default_options(name)},
                    provider="kv_eviction_policies")


def sweep_policies() -> str:
    """Every registered policy except the aliases (a score at a fixed granularity) and those that
    reconstruct their context (KVzip compresses once and refuses decode eviction, which these sweeps
    run; name it in a sweep with compress=context or decode_eviction=false), comma-separated."""
    return ",".join(name for name, entry in REGISTRY.items() if entry.alias_of is None and not entry.reconstructs)


store_policy_configs()
OmegaConf.register_new_resolver("kv_policies", sweep_policies, replace=True)
