"""Console entry points installed by ``pip install -e .`` (pyproject.toml) that are not a module's own ``main``.

``flowspec-run`` is ``./run_pipe.sh`` without the bootstrap: it starts one local process per rank of the stage
root (``model.stage_dir=...`` or the default SmolLM2 split, built on first use) through :mod:`pipeline.tools.launch`
and passes every argument to ``python -m pipeline.run``. ``--help`` and ``--print-config`` need no ranks.
"""
from __future__ import annotations

import os
import sys


def run_main(argv: list[str] | None = None) -> int:
    """flowspec-run [key=value ...] [options]: like ./run_pipe.sh in an environment that is already set up.
    NPROC forces the number of ranks (default: the stage root's manifest)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "--print-config") for a in argv):
        from pipeline.run import main
        return main(argv)
    stage_dir = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in ("model.stage_dir", "stage_dir")),
                     "")
    from model.default_model import DEFAULT_CACHE_DIR, DEFAULT_SPLIT, DefaultModelError, ensure_default_stages
    from model.stage_format import StageDirError, read_manifest
    try:
        stage_dir = stage_dir or str(ensure_default_stages(str(DEFAULT_CACHE_DIR), DEFAULT_SPLIT, progress=True))
        nproc = os.environ.get("NPROC", "") or str(len(read_manifest(stage_dir)["split"]))
    except (DefaultModelError, StageDirError, ValueError, FileNotFoundError) as e:
        print(f"flowspec-run: error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pipeline.tools.launch import main as launch
    return launch(["--standalone", f"--nproc_per_node={nproc}", "-m", "pipeline.run", *argv])
