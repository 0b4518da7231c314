"""Replaying and predicting step times from measured or modelled durations (pure; no process groups)."""

from omni_lightning.balance.pipeline_replay import Action, ReplayResult, one_f_one_b_bubble, replay_pipeline

__all__ = ["Action", "ReplayResult", "one_f_one_b_bubble", "replay_pipeline"]
