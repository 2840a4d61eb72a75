"""Tools on top of the decoding core: launchers, benchmarks, evaluation sweeps, the simulator, reports.

Nothing in ``pipeline/`` (outside this package), ``draft/``, ``model/`` or ``config/`` imports from here
(``tests/test_architecture.py`` checks it): the decode path runs without any of these modules.

Shared by the tools (one copy each): ``ranks`` (the launcher command, a job's environment, running and
stopping a job of ranks), ``rows`` (following a job's rows file, the T=0 check against ``ar`` and its banner);
mode names and labels come from ``config.modes``, finished rows files are read with ``pipeline.outputs``.
"""
