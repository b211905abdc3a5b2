"""Planning a run before it runs: ``kiln plan --search`` and the dry run.

======================  ===========================================================================
:mod:`~kiln.planning.search`      every (dp_shard, tp, pp, checkpointing, microbatches) plan of a transformer on a
                        world of devices, priced by an analytic cost model and ranked
:mod:`~kiln.planning.dry_run`     the real build path of a run (config, Trainer builders, Engine, strategy) on a
                        fake world of any size, with what each rank holds and moves
:mod:`~kiln.planning.fake_world`  the fake process group and fake tensors the dry run stands on
:mod:`~kiln.planning.comm_count`  the collective counter the dry run measures with
======================  ===========================================================================

Why here: a dry run builds exactly what ``kiln train`` builds, so it imports the config builders,
the Trainer's building steps and the Engine. It sits above them, below :mod:`kiln.cli` whose
``plan`` and ``train --dry-run`` commands call it. What the search shares with
``strategy="auto"`` (the device table, the data-parallel step time, the activation measurement)
lives lower, in :mod:`kiln.cost`, so the strategies never reach up into this room.
"""
