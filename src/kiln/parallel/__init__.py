"""Parallel strategies on torch.distributed: single, ddp (and more, one file each)."""

from kiln.parallel.state_dict import full_model_state_dict
from kiln.parallel.strategy import Strategy, get_strategy, register_strategy, strategy_names

__all__ = ["Strategy", "full_model_state_dict", "get_strategy", "register_strategy", "strategy_names"]
