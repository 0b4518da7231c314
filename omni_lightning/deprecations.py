"""Names of release 0.1 kept as aliases that warn once.

Release 0.1 said "balance" for two mechanisms: the loader's sample plan is now *reorder*, the encoder stage's item
plan *reshard*, and the measured per-rank load of a step (the outcome of both) *load*. :data:`RENAMED` is the table
the README prints; every old name still works, with one deprecation warning per process.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

__all__ = ["RENAMED", "warn_renamed", "with_deprecated_names"]

#: Old name -> new name, as a user meets them (arguments, metrics, classes, command-line flags).
RENAMED: dict[str, str] = {
    "OmniStrategy(encoder_balance=...)": "OmniStrategy(encoder_reshard=...)",
    "OmniDataModule(workload_balance=...)": "OmniDataModule(reorder=...)",
    "OmniDataModule(balance_group_size=...)": "OmniDataModule(reorder_group_size=...)",
    "omni_lightning.monitor.BalanceMonitor": "omni_lightning.monitor.LoadMonitor",
    "omni_lightning.datamodules.BalanceSettings": "omni_lightning.datamodules.ReorderSettings",
    "balance/measured_*": "load/measured_*",
    "balance/*": "reorder/*",
    "encoder/*": "reshard/*",
    "omni-lightning simulate --balance-group": "omni-lightning simulate --reorder-group",
}

_warned: set[str] = set()


def warn_renamed(old: str) -> None:
    """Warn, once per process (on rank 0), that ``old`` (a key of :data:`RENAMED`) is deprecated."""
    if old in _warned:
        return
    _warned.add(old)
    rank_zero_deprecation(f"{old} is deprecated, use {RENAMED[old]}: the same thing under a name that says which "
                          "mechanism it is (the old name keeps working for now)")


# The 0.1 prefix of each renamed metric family, and its entry in the table.
_OLD_METRICS = {
    "load": ("balance", "balance/measured_*"),
    "reorder": ("balance", "balance/*"),
    "reshard": ("encoder", "encoder/*"),
}


def with_deprecated_names(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` (``reorder/x``, ``reshard/x``, ``load/x``) and the same values under their 0.1 names (warns once
    per family)."""
    old_names = {}
    for name, value in metrics.items():
        family, _, rest = name.partition("/")
        if family in _OLD_METRICS:
            prefix, entry = _OLD_METRICS[family]
            warn_renamed(entry)
            old_names[f"{prefix}/{rest}"] = value
    return {**metrics, **old_names}
