"""pipeline.tools.ringbench runs a real 2-process gloo ring both ways and prints its table and the ratio line."""
import re
import subprocess
import sys

from tests.helpers import REPO


def test_ringbench_prints_table_and_ratio(tmp_path):
    out = tmp_path / "ring.json"
    res = subprocess.run([sys.executable, "-m", "pipeline.tools.ringbench", "--world", "2", "--trips", "5", "--warmup", "1",
                          "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    last = res.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"overhead ratio \d+\.\d\d", last), last
    import json
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 16]
    assert rows[1]["bytes"] > rows[0]["bytes"] > 0 and all(r["bare_trip_s"] > 0 for r in rows)


def test_ringbench_bad_arguments_are_one_line():
    res = subprocess.run([sys.executable, "-m", "pipeline.tools.ringbench", "--world", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "--world >= 2" in res.stderr
