"""``python -m pipeline.tools.simulate``: the what-if simulator's command line (:mod:`.cli`)."""
from pipeline.tools.simulate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
