"""Pipeline parallelism's parts: the :mod:`~kiln.parallel.pipelining.runtime` (traced stages,
microbatches, ``schedule.step``), the :mod:`~kiln.parallel.pipelining.schedules` and which stages a
rank holds, the stage :mod:`~kiln.parallel.pipelining.boundary` (dtypes across a cut), tracing as
one tensor-parallel rank (:mod:`~kiln.parallel.pipelining.tp_trace`) and the traced casts
(:mod:`~kiln.parallel.pipelining.traced_casts`). The ``pp`` and ``hybrid`` strategies
(:mod:`kiln.parallel.pipeline`, :mod:`kiln.parallel.hybrid`) drive them.
"""
