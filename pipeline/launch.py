"""``torchrun`` without its traceback wall: ``python -m pipeline.launch <torchrun arguments>``.

Every rank of ``pipeline.run`` already prints one ``[rank r] error: ...`` line when something fails;
torchrun's agent would add a long ``ChildFailedError`` traceback and a root-cause table. This wrapper
runs the same agent (``torch.distributed.run.main``), keeps its logging at ERROR, and turns a failure
into one line naming the first failed rank plus a meaningful exit code. ``FLOWSPEC_DEBUG=1`` restores
torchrun's full output.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

PEER_CODES = (3, -signal.SIGTERM, 128 + signal.SIGTERM)  # ranks that only reacted to another's failure


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    from torch.distributed.run import main as torchrun_main
    if os.environ.get("FLOWSPEC_DEBUG", "") in ("", "0"):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        try:
            torchrun_main(argv)
        except ChildFailedError as e:
            failures = sorted(e.failures.items())
            first_rank, first = e.get_first_failure()
            code = first.exitcode
            if code < 0:
                print(f"[launch] rank {first.global_rank if first.global_rank is not None else first_rank} "
                      f"died from signal {signal.Signals(-code).name}", file=sys.stderr, flush=True)
            own = [f.exitcode for _, f in failures if f.exitcode not in PEER_CODES and f.exitcode > 0]
            return own[0] if own and own[0] < 256 else 1
        except SignalException as e:
            return 128 + int(e.sigval)
        return 0
    torchrun_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
