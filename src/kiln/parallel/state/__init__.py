"""Distributed state under every strategy: the validated device mesh
(:mod:`~kiln.parallel.state.mesh`), DCP model and optimizer state dicts
(:mod:`~kiln.parallel.state.dcp_state`), full unwrapped weights
(:mod:`~kiln.parallel.state.state_dict`), the global gradient norm over sharded parameters
(:mod:`~kiln.parallel.state.grad_norm`) and the optimizer's parameters followed through a
transformation (:mod:`~kiln.parallel.state.optimizer_params`). The ground the transformations and
strategies stand on: nothing here imports them.
"""
