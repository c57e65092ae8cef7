"""Agents that set the CONF-KV knobs: stable-baselines3 learners, the requirement's rule, and their export."""

from agents.export import export_sb3
from agents.rule import RuleAgent
from agents.sb3 import ALGOS, train_sb3

__all__ = ["ALGOS", "RuleAgent", "export_sb3", "train_sb3"]
