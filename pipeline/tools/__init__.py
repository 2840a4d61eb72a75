"""Tools on top of the decoding core: launchers, benchmarks, evaluation sweeps, the simulator, reports.

Nothing in ``pipeline/`` (outside this package), ``draft/``, ``model/`` or ``config/`` imports from here
(``tests/test_architecture.py`` checks it): the decode path runs without any of these modules.
"""
