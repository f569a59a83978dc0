"""The build's steps, each a function over a :class:`~worker.steps.context.BuildContext` that
returns what it made: ``toolkit`` (which nvcc), ``source`` (fetch, verify, unpack, lock, patch),
``venv`` (torch and the build requirements, the torch check), ``compile`` (MAX_JOBS, the compile
cache, the compile, learned memory peaks), ``checks`` (the wheel, its device code, the load
check) and ``publish`` (the record, the log). :func:`worker.build.run_build` calls them in order.
Programs run through :class:`worker.supervision.runner.Runner`; reports go through the context's
:class:`worker.events.Journal`.
"""
