"""What a plan costs: memory per rank and seconds per step, and ``strategy="auto"``, which chooses by them.

======================  ===========================================================================
:mod:`~kiln.cost.memory`       each data-parallel strategy's bytes per rank, in closed form (``kiln plan``'s
                        table, ``kiln.parallel.plan_table``), and the row auto takes
:mod:`~kiln.cost.activations`  a microbatch's activation bytes, measured on fake tensors (no memory, no compute)
:mod:`~kiln.cost.step_time`    a data-parallel step's communication and recomputation in seconds
:mod:`~kiln.cost.devices`      the device table those seconds come from (``kiln plan --search --device``)
:mod:`~kiln.cost.auto`         ``strategy="auto"``: a strategy that estimates each candidate at ``setup``,
                        then is the one it chose
======================  ===========================================================================

Why a room of its own, and why here. The choice ``strategy="auto"`` makes is resolved when the
strategy is set up, from these estimates; ``kiln plan --search`` and the dry run
(:mod:`kiln.planning`) use the same device table, memory rules and activation measurement. The
estimates need the model transformations (which blocks a mode checkpoints, which layers a TP plan
splits: :mod:`kiln.parallel.transforms`) and nothing above the strategies, so this package sits
just above :mod:`kiln.parallel` and below the Engine: low enough for the Engine and the Trainer to
use auto, and for the planning room above the Trainer to share its rules. The strategy registry
names ``Auto`` by path (``"kiln.cost.auto:Auto"``), as it names every strategy, so
:mod:`kiln.parallel` imports nothing from here.
"""
