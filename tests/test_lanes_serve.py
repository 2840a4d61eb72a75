"""Several requests in flight through the real launched server (3 ranks, torch.distributed gloo, stories260K):
``serve.max_active=2``. Concurrent greedy answers equal the server's one-at-a-time answers (and HF's), the two
requests overlap in time, a third one waits for a lane; killing a stage answers every request in flight 503."""
import concurrent.futures
import time

import httpx
import pytest
import torch

from model.split import split_checkpoint
from tests.helpers import STORIES, hf_greedy
from tests.test_serve import Server, post

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="../shared/models/stories260K is not available")
PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park"]
MODES = ["continuous", "naive", "pipedec"]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    return split_checkpoint(STORIES, tmp_path_factory.mktemp("lanes_serve") / "stages", [0, 3, 2], progress=False)


def _ask(server, prompt: str, mode: str, max_tokens: int = 20) -> dict:
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "mode": mode, "temperature": 0,
                                          "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    spec = r.json()["speculative"]
    return {"ids": spec["output_ids"], "prompt_ids": spec["prompt_ids"], "t0": t0, "t1": time.monotonic()}


def test_two_in_flight_equal_one_at_a_time(stages, tmp_path):
    s = Server([f"model.stage_dir={stages}", f"head_dir=oracle:{STORIES}", "serve.max_active=2", "comm.timeout_s=20",
                "--modes", ",".join(MODES)], tmp_path / "server.log")
    try:
        alone = [_ask(s, p, m) for p, m in zip(PROMPTS, MODES)]
        for a in alone:
            assert a["ids"] == hf_greedy(STORIES, a["prompt_ids"], 20, {2}, torch.float32)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            together = list(ex.map(lambda pm: _ask(s, *pm), zip(PROMPTS, MODES)))
        assert [t["ids"] for t in together] == [a["ids"] for a in alone]
        ends = sorted(t["t1"] for t in together)
        assert max(t["t0"] for t in together[:2]) < min(t["t1"] for t in together[:2]), "no overlap in time"
        assert ends[-1] > ends[0]
    finally:
        code = s.stop()
    assert code in (0, 130), s.log.read_text()[-2000:]


def test_killed_stage_fails_every_request_in_flight(stages, tmp_path):
    s = Server([f"model.stage_dir={stages}", f"head_dir=oracle:{STORIES}", "serve.max_active=2", "comm.timeout_s=5",
                "comm.heartbeat_s=0.2"], tmp_path / "server.log", env={"FLOWSPEC_FAULT": "rank=2,at=segment,count=6"})
    try:
        t0 = time.monotonic()
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64, "mode": "naive"}
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            rs = list(ex.map(lambda _: httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60), range(2)))
        assert [r.status_code for r in rs] == [503, 503], [r.text for r in rs]
        s.proc.wait(15)
        elapsed = time.monotonic() - t0
    finally:
        code = s.stop(timeout=5)
    assert code != 0 and elapsed < 20, (code, elapsed, s.log.read_text()[-2000:])
