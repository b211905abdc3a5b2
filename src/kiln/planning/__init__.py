"""Planning a run before it runs: ``kiln plan --search`` and the dry run.

=========================================  ========================================================
:mod:`~kiln.planning.search`               every (dp_shard, tp, pp, checkpointing, microbatches) plan
                                           of a transformer on a world of devices, ranked
:mod:`~kiln.planning.search_shape`         what the search knows of a model: its sizes and layouts
:mod:`~kiln.planning.search_plan`          one searched plan, and the search's result
:mod:`~kiln.planning.search_memory`        a plan's memory per rank, in closed form
:mod:`~kiln.planning.search_collectives`   a plan's collective bytes per step, in closed form
:mod:`~kiln.planning.search_cost`          a plan's price (memory, bytes, seconds) and the order
:mod:`~kiln.planning.search_text`          the search's sizes read and its table printed
:mod:`~kiln.planning.confirm`              ``--confirm``: the first plans dry-run before ranking
:mod:`~kiln.planning.dry_run`              the real build path of a run (config, Trainer builders,
                                           Engine, strategy) on a fake world of any size, with what
                                           each rank holds and moves
:mod:`~kiln.planning.shared_trace`         one trace of a pipelined model, shared by the ranks
:mod:`~kiln.planning.rank_workers`         the ranks after the first measured side by side, in
                                           processes forked from the dry run's
:mod:`~kiln.planning.fake_world`           the fake process group and fake tensors of the dry run
:mod:`~kiln.planning.comm_count`           the collective counter the dry run measures with
=========================================  ========================================================

Why here: a dry run builds exactly what ``kiln train`` builds, so it imports the config builders,
the Trainer's building steps and the Engine. It sits above them, below :mod:`kiln.cli` whose
``plan`` and ``train --dry-run`` commands call it. What the search shares with
``strategy="auto"`` (the device table, the data-parallel step time, the activation measurement)
lives lower, in :mod:`kiln.cost`, so the strategies never reach up into this room.
"""
