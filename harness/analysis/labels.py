"""How tables and plots name a run: its policy variant and its budget, and the order rows read in."""
from __future__ import annotations

import pandas as pd


def variant_label(config: dict) -> str:
    """The policy's name plus whatever makes this run differ from its defaults: options away from
    the policy's own defaults, a block size other than the engine's, layer groups and their budget
    schedule (``paged[per_head=True]``, ``paged[block_size=64]``,
    ``paged[layer_groups=3, budget_schedule=pyramid]``). Tables and plots key rows by it, so ablations read apart."""
    from policies import REGISTRY, default_options

    from harness.eviction.settings import EvictionSettings

    settings = EvictionSettings.from_run_config(config)
    name = settings.policy
    defaults = default_options(name) if name in REGISTRY else {}
    missing = object()
    changed = [f"{key}={value}" for key, value in sorted(settings.options.items()) if defaults.get(key, missing) != value]
    if name != "full":  # full cache generates the same at any layer groups and scope
        changed += settings.variant_marks((config.get("engine") or {}).get("layer_groups", 1))
    engine_block = (config.get("engine") or {}).get("block_size")
    if engine_block is not None and config.get("block_size") not in (None, engine_block):
        changed.append(f"block_size={config['block_size']}")
    return name + (f"[{', '.join(changed)}]" if changed else "")


ROW = ["variant", "budget"]  # how tables key their rows: the policy variant and the budget label


def budget_label(row) -> str:
    """A run's budget as a label: the token count, ``r0.5`` for a compression ratio (share of each
    prompt removed), or "all" for full cache (it keeps every token)."""
    ratio = row.get("budget_ratio")
    if ratio is not None and ratio == ratio:
        return f"r{ratio:g}"
    budget = row.get("budget")
    return "all" if budget is None or budget != budget else str(int(budget))


def with_budget_label(frame: pd.DataFrame) -> pd.DataFrame:
    """``budget`` as a label (``budget_label``)."""
    labelled = frame.copy()
    labelled["budget"] = [budget_label(row) for _, row in frame.iterrows()]
    return labelled


def in_reading_order(table: pd.DataFrame) -> pd.DataFrame:
    """Rows (variant, budget label): full cache first, then each variant by name, budgets ascending."""
    def key(row):
        policy, budget = row
        order = int(budget) if budget.isdigit() else float(budget[1:]) if budget.startswith("r") else -1
        return (policy != "full", policy, budget.startswith("r"), order)

    return table.loc[sorted(table.index, key=key)]


def signed(value: float, decimals: int) -> str:
    """A signed number at ``decimals`` places, with more places where a non-zero bound would print
    as zero (issue 65: "+0.000" beside p < 0.05 hid which side of zero the bound lies on)."""
    text = f"{value:+.{decimals}f}"
    while value == value and value != 0 and float(text) == 0 and decimals < 8:
        decimals += 1
        text = f"{value:+.{decimals}f}"
    return text


def with_interval(value, low, high, decimals: int = 1) -> str:
    """A cell of an interval table: ``mean (low, high)``."""
    return f"{value:.{decimals}f} ({low:.{decimals}f}, {high:.{decimals}f})"


def markdown_table(table: pd.DataFrame) -> str:
    """A policy x budget table with ``policy`` and ``budget`` as plain columns (no tuple labels)."""
    return table.reset_index().rename(columns={"variant": "policy"}).to_markdown(index=False)
