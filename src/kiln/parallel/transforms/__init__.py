"""The model transformations that strategies apply, in torchtitan's order
(:mod:`~kiln.parallel.transforms.parallelize` holds the order and says why it matters).

placement and precision, :mod:`~kiln.parallel.transforms.float8`, (pipeline cut),
:mod:`~kiln.parallel.transforms.tensor_parallel`, :mod:`~kiln.parallel.transforms.expert_parallel`,
activation checkpointing and compile (:mod:`~kiln.parallel.transforms.levers`),
:mod:`~kiln.parallel.transforms.data_parallel` (FSDP2). Each is a function of a model and a
``ParallelizePlan``; a strategy chooses which it runs. Nothing here imports a strategy.
"""
