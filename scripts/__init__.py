"""Developer scripts, run from the repository root as modules (no ``sys.path`` edits):

    .venv/bin/python -m scripts.serve_bench --help      # HTTP server overhead against pipeline.run
    .venv/bin/python -m scripts.fault_matrix --help     # launcher fault sweep (tests/test_launchers.py runs a slice)
"""
