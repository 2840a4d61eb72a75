"""Every rank of test_serve's in-process API job runs this script (``pipeline.serve.entry`` with a client).

``python -m pipeline.tools.launch --standalone --nproc_per_node=3 -m tests.serve_inproc_client OUT.json [serve args]``:
rank 0's client submits requests through :class:`pipeline.serve.RequestManager` and writes what it saw to
OUT.json; HTTP keeps serving until the file OUT.json.stop appears (at once with ``--no-http``), then the client
calls ``manager.stop()``: the request in flight finishes, every rank exits 0.
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline import serve  # noqa: E402


def client(manager) -> None:
    out = {}
    req = manager.submit(prompt="Once upon a time", max_tokens=16, mode="continuous")
    out["chunks"] = [list(t) for t in req]
    out["first"] = {"prompt_ids": req.prompt_ids, "ids": req.ids, "text": req.text, "stats": req.stats,
                    "finish_reason": req.finish_reason, "state": req.state}
    long = manager.submit(prompt="The little dog", max_tokens=300, mode="naive")
    next(iter(long))            # its first commit...
    long.cancel()               # ...then cancel: it ends at the next commit
    long.wait(60)
    out["cancelled"] = {"state": long.state, "n": len(long.ids)}
    try:
        manager.submit(prompt="x", mode="warp")
        out["bad"] = None
    except serve.RequestError as e:
        out["bad"] = {"message": str(e), "param": e.param}
    again = manager.submit(prompt="Once upon a time", max_tokens=16, mode="pipedec").wait(60)
    out["again"] = again.ids
    Path(sys.argv[1] + ".tmp").write_text(json.dumps(out))
    Path(sys.argv[1] + ".tmp").rename(sys.argv[1])
    while "--no-http" not in sys.argv and not Path(sys.argv[1] + ".stop").exists():
        time.sleep(0.2)
    manager.stop()


if __name__ == "__main__":
    from pipeline.run import exit_now
    exit_now(serve.entry(sys.argv[2:], client=client))   # as every launched rank: no finalization race (exit_now)
