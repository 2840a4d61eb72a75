"""The HTTP server (pipeline/serve.py) through real processes and real HTTP: no mocks.

One stories260K server (3 ranks, oracle drafter: long accepted paths) is shared by most tests; separate jobs
cover SIGTERM (two launches), several hosts and the SmolLM2 default through ./run_serve.sh (with Ctrl-C). A killed
stage rank (503, every rank exits): tests/test_lanes_serve.py::test_killed_stage_fails_every_request_in_flight.
Greedy answers are compared with HF ``generate`` on the unsplit model (the reference pipeline.run is tested
against in test_e2e.py), token for token.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from model.split import split_checkpoint
from tests.helpers import REPO, STORIES, free_port, hf_greedy

MODES = ("ar", "naive", "pruned", "pipedec", "continuous")
STOP = {2}
pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="../shared/models/stories260K is not available")


READY = re.compile(r"\[serve\] ready: http://127\.0\.0\.1:(\d+)/")


class Server:
    """``./run_serve.sh ... --port 0`` (or ``cmd ... --port 0``) in its own process group; output goes to ``log``.
    The server binds a free port itself and prints it on its ready line, which sets ``port`` and ``url``: a port
    picked here and bound there later could be taken in between by another test's ranks (a CI run lost a test to
    exactly that: "cannot listen on 127.0.0.1:43601: Address already in use")."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, timeout: float = 120,
                 cmd: list[str] | None = None) -> None:
        self.port, self.url = None, None
        self.log = log
        e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        e.pop("FLOWSPEC_DEBUG", None)
        with open(log, "w") as f:
            self.proc = subprocess.Popen([*(cmd or [str(REPO / "run_serve.sh")]), *args, "--port", "0"], cwd=REPO,
                                         env=e, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            if self.url is None and (m := READY.search(log.read_text(errors="replace"))):
                self.port = int(m.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
            try:
                if self.url is not None and httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise AssertionError(f"server not ready after {timeout}s:\n{log.read_text()[-3000:]}")

    def stop(self, sig=signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def stories_stages(tmp_path_factory):
    return split_checkpoint(STORIES, tmp_path_factory.mktemp("serve") / "stages", [0, 3, 2], progress=False)


@pytest.fixture(scope="module")
def server(stories_server):
    """The shared stories260K server (3 ranks, --queue-size 16): tests/conftest.py's session fixture, shared with
    tests/test_serve_fields.py (issue 43: one launch for both modules in a test process). It is launched through
    tests/serve_inproc_client.py, whose rank-0 client exercises the in-process API first (see
    test_in_process_request_api) and then leaves HTTP serving."""
    return stories_server


def launch_stories_server(tmp_path_factory):
    """Launch the shared server (see ``server``); a generator for tests/conftest.py's ``stories_server``: at the
    session's end the in-process client calls ``manager.stop()``, and every rank must exit 0."""
    tmp = tmp_path_factory.mktemp("serve_log")
    stages = split_checkpoint(STORIES, tmp / "stages", [0, 3, 2], progress=False)
    inproc = tmp / "inproc.json"
    s = Server([str(inproc), f"model.stage_dir={stages}", f"head_dir=oracle:{STORIES}", "max_new_tokens=24",
                "comm.timeout_s=20", "--queue-size", "16"], tmp / "server.log",
               cmd=[sys.executable, "-m", "pipeline.tools.launch", "--standalone", "--nproc_per_node=3", "-m",
                    "tests.serve_inproc_client"])
    s.inproc, s.stages = inproc, stages
    deadline = time.monotonic() + 120
    while not inproc.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    yield s
    Path(str(inproc) + ".stop").touch()   # the in-process client calls manager.stop(): a clean exit of every rank
    try:
        code = s.proc.wait(60)
    finally:
        s.stop(signal.SIGKILL)
    assert code == 0, f"manager.stop() should end the job with 0, got {code}:\n{s.log.read_text()[-2000:]}"


def model_id(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)


def sse(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


_tok = None


def tokenizer():
    global _tok
    if _tok is None:
        from transformers import AutoTokenizer
        _tok = AutoTokenizer.from_pretrained(STORIES)
    return _tok


def reference(prompt_ids: list[int], max_new: int) -> list[int]:
    return hf_greedy(STORIES, prompt_ids, max_new, STOP, torch.float32)


def text_of(ids: list[int]) -> str:
    return tokenizer().decode([t for t in ids if t not in STOP], skip_special_tokens=True)


def test_openai_client_and_httpx_every_mode_equal_hf(server):
    """Both clients, chat and completions, streamed and not, every mode: greedy ids equal HF's.

    The chat carries a short system message (issue 43): it replaces the Vicuna template's 100-token default system
    prompt (stories260K has no chat template of its own), which made continuous mode's 12 tokens take ~15 s here,
    because the oracle drafter then re-read the whole context for every row of its trees (it keeps the context's KV
    cache since docs/results.md §86; the short chat stays the cheaper one). The template's formatting is
    the same path (its default system prompt: tests/test_serve_fields.py's chat requests)."""
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    name = model_id(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story about a cat."}]
    for mode in MODES:
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"mode": mode, "return_token_ids": True})
        spec = r.model_extra["speculative"]
        assert spec["mode"] == mode and spec["output_ids"] == reference(spec["prompt_ids"], 12), mode
        assert r.choices[0].message.content == text_of(spec["output_ids"])
        assert r.usage.completion_tokens == len(spec["output_ids"]) == spec["new_tokens"]
        assert r.choices[0].finish_reason in ("stop", "length")
        assert spec["steps"] == len(spec["accept_lengths"]) and spec["decode_s"] > 0 and spec["prefill_s"] > 0
        assert spec["tau"] == pytest.approx(sum(spec["accept_lengths"]) / max(1, spec["steps"]), abs=1e-3)
        assert spec["drafter_version"] == (None if mode == "ar" else 0), mode   # no online learning here
        if mode in ("naive", "pruned", "continuous"):  # the oracle drafter: long accepted paths (pipedec: 1/step)
            assert spec["tau"] > 1.5, spec
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"mode": mode})
        parts, chunks = [], list(stream)
        for c in chunks:
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
        assert "".join(parts) == r.choices[0].message.content, mode
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        assert chunks[-1].model_extra["speculative"]["accept_lengths"] == spec["accept_lengths"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason

        # plain httpx, /v1/completions with a raw text prompt and with token ids
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 16, "mode": mode, "return_token_ids": True}
        j = post(server, "/v1/completions", body).json()
        ids = j["speculative"]["prompt_ids"]
        assert ids == tokenizer()("Once upon a time")["input_ids"]
        assert j["speculative"]["output_ids"] == reference(ids, 16), mode
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "prompt": ids},
                          timeout=120) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = [l for l in resp.iter_lines() if l]
        assert lines[-1] == "data: [DONE]"
        events = sse(lines)
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == j["choices"][0]["text"]
        assert events[-1]["speculative"]["output_ids"] == j["speculative"]["output_ids"]


def test_sixteen_concurrent_clients_fifo_once_each(server):
    """16 clients x 2 requests: each answered once, served in arrival order, answers equal sequential ones.

    The sequential answer of a prompt in every mode is HF's greedy answer (test_openai_client_and_httpx_every_mode_
    equal_hf proves a request alone equals HF in every mode), so each concurrent answer is compared with HF's text
    directly: the 20 sequential requests this test sent first are gone (issue 43), the check is the same or tighter.
    Two requests per client (was four, issue 43): 16 at once still fill the 4 lanes and 12 places of the queue
    (--queue-size 16), each client's second request reuses its connection, and the 32 requests still cover every
    prompt and every mode (17 of the 20 prompt x mode pairs; four requests covered 19)."""
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to", "One day, a bird"]
    body = lambda i, k: {"prompt": prompts[(i + k) % 4], "max_tokens": 8, "mode": MODES[(i + k) % 5]}
    alone = [text_of(reference(tokenizer()(p)["input_ids"], 8)) for p in prompts]
    assert len(set(alone)) == 4
    results, errors = [], []

    def client(i: int) -> None:
        with httpx.Client(timeout=300) as c:
            for k in range(2):
                try:
                    r = c.post(server.url + "/v1/completions", json=body(i, k))
                    assert r.status_code == 200, r.text
                    j = r.json()
                    results.append(((i + k) % 4, (i + k) % 5, j["id"], j["speculative"]["seq"],
                                    j["speculative"]["order"], j["choices"][0]["text"]))
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[:3]
    assert len(results) == 32 and len({r[2] for r in results}) == 32 and len({r[3] for r in results}) == 32
    assert {r[0] for r in results} == set(range(4)) and {r[1] for r in results} == set(range(5))
    by_arrival = sorted(results, key=lambda r: r[3])
    assert [r[4] for r in by_arrival] == sorted(r[4] for r in results), "not served in arrival order"
    for p, m, _, _, _, text in results:
        assert text == alone[p], MODES[m]


def test_queue_overflow_429_then_disconnects_cancel(server):
    """A burst beyond --queue-size 16 (and the requests in flight) gets 429s; closing the streams cancels them; the
    next answer is right."""
    name = model_id(server)

    async def burst():
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = [c.build_request("POST", server.url + "/v1/completions",
                                    json={"model": name, "prompt": f"Story {i}", "max_tokens": 400, "mode": "ar",
                                          "stream": True}) for i in range(26)]
            resps = await asyncio.gather(*(c.send(r, stream=True) for r in reqs))
            codes = [r.status_code for r in resps]
            for r in resps:
                if r.status_code == 429:
                    err = json.loads(await r.aread())["error"]
                    assert err["code"] == "queue_full" and err["message"]
                await r.aclose()   # the client goes away: queued requests are dropped, the running one stops
            return codes

    before = httpx.get(server.url + "/metrics").text
    codes = asyncio.run(burst())
    from pipeline.lanes import AUTO_MAX_ACTIVE   # the server's requests in flight (serve.max_active's default)
    assert codes.count(429) >= 26 - 16 - AUTO_MAX_ACTIVE and set(codes) == {200, 429}, codes
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = httpx.get(server.url + "/health").json()
        if h["queue_length"] == 0 and not h["busy"]:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the cancelled requests did not drain: {h}")
    after = httpx.get(server.url + "/metrics").text
    assert metric(after, 'flowspec_requests_total{outcome="cancelled"}') - \
        metric(before, 'flowspec_requests_total{outcome="cancelled"}') == codes.count(200)
    assert metric(after, 'flowspec_requests_total{outcome="rejected_queue_full"}') >= codes.count(429)
    j = post(server, "/v1/completions", {"prompt": "The dog ran", "max_tokens": 16, "mode": "continuous",
                                         "return_token_ids": True}).json()
    assert j["speculative"]["output_ids"] == reference(j["speculative"]["prompt_ids"], 16)


def test_disconnect_mid_stream_then_correct_answer(server):
    """A client leaving mid-stream cancels its generation (naive and continuous); the next answer equals HF's.
    Short system messages (issue 43): see test_openai_client_and_httpx_every_mode_equal_hf."""
    brief = {"role": "system", "content": "Be brief."}
    body = {"messages": [brief, {"role": "user", "content": "Tell a long story."}], "max_tokens": 300, "stream": True}
    for mode in ("naive", "continuous"):
        before = metric(httpx.get(server.url + "/metrics").text, 'flowspec_generated_tokens_total')
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "mode": mode}, timeout=60) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content": "' in line:
                    got += 1
                    if got == 2:
                        break   # leave mid-stream
        j = post(server, "/v1/chat/completions", {"messages": [brief, {"role": "user", "content": "Sing a song."}],
                                                  "max_tokens": 20, "mode": mode, "return_token_ids": True}).json()
        assert j["speculative"]["output_ids"] == reference(j["speculative"]["prompt_ids"], 20), mode
        generated = metric(httpx.get(server.url + "/metrics").text, 'flowspec_generated_tokens_total') - before
        assert generated - len(j["speculative"]["output_ids"]) < 200, "the abandoned generation was not cancelled"


def test_bad_requests_400_and_server_keeps_serving(server):
    cases = [
        (b"{not json", None), (b"[1, 2]", None),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({"prompt": "x", "mode": "fast"}, "mode"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 10 ** 6]}, "prompt"),
        ({"prompt": "x " * 600, "max_tokens": 16}, "prompt"),     # longer than stories260K's 512 positions
        ({"max_tokens": 3}, "prompt"),
    ]
    for body, param in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + "/v1/completions", timeout=30, **kw)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, err
    for msgs in ([], [{"role": "assistant", "content": "hi"}], [{"role": "user"}], "hello",
                 [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]):
        r = post(server, "/v1/chat/completions", {"messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (msgs, r.text)
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_sampling_seeded_and_stop_strings(server):
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7,
            "mode": "continuous", "return_token_ids": True}
    a = post(server, "/v1/completions", body).json()
    b = post(server, "/v1/completions", body).json()
    assert a["speculative"]["output_ids"] == b["speculative"]["output_ids"] and a["speculative"]["seed"] == 7
    greedy = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24}).json()
    text = greedy["choices"][0]["text"]
    stop = text[8:12]
    s = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "stop": [stop]}).json()
    assert s["choices"][0]["text"] == text[:text.find(stop)] and s["choices"][0]["finish_reason"] == "stop"


def metric(text: str, name: str) -> float:
    m = re.search("^" + re.escape(name) + r" (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_models_health_metrics(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    post(server, "/v1/completions", {"prompt": "A bird", "max_tokens": 8, "mode": "naive"})
    text = httpx.get(server.url + "/metrics").text
    steps, acc = metric(text, "flowspec_verification_steps_total"), metric(text, "flowspec_accepted_tokens_total")
    assert steps > 0 and metric(text, "flowspec_tau") == pytest.approx(acc / steps, rel=1e-4)
    assert metric(text, "flowspec_generated_tokens_total") >= acc
    assert metric(text, 'flowspec_rank_busy_fraction{rank="0"}') > 0
    assert metric(text, 'flowspec_rank_busy_fraction{rank="2"}') > 0
    assert metric(text, "flowspec_queue_length") == 0
    assert "# TYPE flowspec_requests_total counter" in text


def page_when_done(chromium: str, url: str, profile: Path, shot: Path, deadline_s: float) -> str:
    """Open ``url`` in headless Chromium, wait (real time) until the page marks ``document.body.dataset.done``, then
    return its DOM and save a screenshot. Driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    NUL-terminated JSON on fds 3/4): ``--dump-dom`` with ``--virtual-time-budget`` dumps when *virtual* time runs out,
    which the page's 1-second status poll spends in a few real seconds, so on a loaded machine it caught the answer
    mid-stream (Chromium 156)."""
    import base64
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    proc = subprocess.Popen(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
         "--window-size=1000,700", "--remote-debugging-pipe", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False,   # fds 3 and 4 must survive the exec
        preexec_fn=lambda: (os.dup2(to_chrome_r, 3), os.dup2(from_chrome_w, 4)))  # (dup2's copies are inheritable)
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    buf, ids = b"", iter(range(1, 10 ** 6))

    def call(method: str, params: dict | None = None, session: str | None = None) -> dict:
        nonlocal buf
        i = next(ids)
        msg = {"id": i, "method": method, "params": params or {}} | ({"sessionId": session} if session else {})
        os.write(to_chrome_w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in buf:
                chunk = os.read(from_chrome_r, 1 << 20)
                assert chunk, f"chromium closed the DevTools pipe during {method}"
                buf += chunk
            line, buf = buf.split(b"\0", 1)
            reply = json.loads(line)
            if reply.get("id") == i:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    try:
        target = call("Target.createTarget", {"url": url})["targetId"]
        session = call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def js(expr: str):
            return call("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session)["result"].get("value")

        end = time.monotonic() + deadline_s
        while js("document.body && document.body.dataset.done") != "1" and time.monotonic() < end:
            time.sleep(0.5)
        shot.write_bytes(base64.b64decode(call("Page.captureScreenshot", {}, session)["data"]))
        return js("document.documentElement.outerHTML")
    finally:
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        proc.kill()
        proc.wait(timeout=30)


def test_page_in_headless_chromium(server, tmp_path):
    """The page (no internet asset) streams an answer and shows τ and tokens/s; screenshot kept. Naive mode (was
    continuous, issue 43): the page's chat carries the Vicuna template's 100-token system prompt, on which the
    oracle drafter's continuous-mode trees cost ~1 s a step here; the page does not depend on the mode."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not found (Debian: apt-get install chromium)")
    page = httpx.get(server.url + "/").text
    assert "http://" not in page and "https://" not in page, "the page must not load internet assets"
    shot = tmp_path / "serve_page.png"
    url = server.url + "/?prompt=Tell%20a%20story&autostart=1&max_tokens=24&mode=naive"
    dom = page_when_done(chromium, url, tmp_path / "profile", shot, deadline_s=110)
    answer = re.search(r'id="answer">([^<]*)<', dom)
    assert answer and 'data-done="1"' in dom, dom[-2000:]
    ref = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}],
                                                "max_tokens": 24, "mode": "naive"}).json()
    import html
    assert html.unescape(answer.group(1)) == ref["choices"][0]["message"]["content"]
    tau = re.search(r'id="tau">([\d.]+)<', dom)
    tps = re.search(r'id="tps">([\d.]+)<', dom)
    assert tau and float(tau.group(1)) == pytest.approx(ref["speculative"]["tau"], abs=0.01)
    assert tps and float(tps.group(1)) > 0
    assert len(re.findall(r'id="bar\d"', dom)) == 3
    assert shot.is_file() and shot.stat().st_size > 5000
    print(f"\npage screenshot: {shot}")


def test_smollm2_default_through_run_serve_sh(tmp_path):
    """The embedded default (5 ranks) via ./run_serve.sh: greedy chat answers equal HF's; Ctrl-C ends it."""
    from transformers import AutoTokenizer
    from model.default_model import ensure_default_checkpoint
    from model.prompts import chat_prompt_ids, stop_token_ids
    full = ensure_default_checkpoint()
    s = Server(["max_new_tokens=16"], tmp_path / "server.log", timeout=240)
    try:
        from openai import OpenAI
        client = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name three colors."}]
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                           extra_body={"mode": "continuous", "return_token_ids": True})
        tok = AutoTokenizer.from_pretrained(full)
        ids = chat_prompt_ids(tok, ["Name three colors."], [])
        stop = stop_token_ids(tok, json.loads((Path(full) / "generation_config.json").read_text()))
        spec = r.model_extra["speculative"]
        assert spec["prompt_ids"] == ids
        ref = hf_greedy(full, ids, 12, stop, torch.float32)
        assert spec["output_ids"] == ref
        # streamed, another mode: its first 6 tokens (was 12, issue 43: naive mode costs ~0.6 s a token here)
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=name, messages=messages, max_tokens=6, stream=True, extra_body={"mode": "naive"}) if c.choices]
        assert "".join(parts) == tok.decode([t for t in ref[:6] if t not in stop], skip_special_tokens=True)
    finally:
        t0 = time.monotonic()
        code = s.stop(signal.SIGINT, timeout=30)
    assert code == 130 and time.monotonic() - t0 < 15, (code, s.log.read_text()[-2000:])


def test_in_process_request_api(server):
    """RequestManager on rank 0: submit, iterate committed tokens, stats, cancel, bad input (the shared server's
    in-process client ran these before any HTTP traffic; its manager.stop() ends that server in the fixture)."""
    out = server.inproc
    assert out.exists(), server.log.read_text()[-3000:]
    j = json.loads(out.read_text())
    first = j["first"]
    assert first["ids"] == reference(first["prompt_ids"], 16) == [t for c in j["chunks"] for t in c]
    assert 1 <= len(j["chunks"]) <= first["stats"]["steps"] + 1   # commits (a slow reader may get several at once)
    assert first["text"] == text_of(first["ids"]) and first["state"] == "done"
    assert j["cancelled"]["state"] == "cancelled" and j["cancelled"]["n"] < 300
    assert j["bad"]["param"] == "mode"
    assert j["again"] == first["ids"]


def test_several_hosts_through_run_serve_sh(stories_stages, tmp_path):
    """run_serve.sh with NODE_RANK (one launcher per host, here three on localhost, each with its own copy of the
    stage root): host 0 serves, greedy answers equal HF's in a speculative mode, Ctrl-C on host 0 ends every host."""
    import shutil
    mport = free_port()
    common = dict(NNODES="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(mport))
    others = []
    for k in (1, 2):
        root = tmp_path / f"host{k}"
        shutil.copytree(stories_stages, root)
        log = open(tmp_path / f"host{k}.log", "w")
        others.append(subprocess.Popen([str(REPO / "run_serve.sh"), f"head_dir=oracle:{STORIES}", "comm.timeout_s=20"],
                                       cwd=REPO, env=dict(os.environ, **common, NODE_RANK=str(k), STAGE_DIR=str(root), OMP_NUM_THREADS="1"),
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    s = None
    try:
        s = Server([f"head_dir=oracle:{STORIES}", "comm.timeout_s=20"], tmp_path / "host0.log", timeout=180,
                   env={**common, "NODE_RANK": "0", "STAGE_DIR": str(stories_stages)})
        body = {"model": model_id(s), "prompt": "Once upon a time", "max_tokens": 16, "mode": "continuous",
                "return_token_ids": True}
        j = post(s, "/v1/completions", body).json()
        assert j["speculative"]["output_ids"] == reference(j["speculative"]["prompt_ids"], 16)
        assert j["speculative"]["tau"] > 1.5   # the oracle drafter: long accepted paths across hosts
    finally:
        t0 = time.monotonic()
        code = s.stop(signal.SIGINT, timeout=40) if s is not None else None
        rest = []
        for p in others:
            try:
                rest.append(p.wait(40))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rest.append("hung")
        took = time.monotonic() - t0
    logs = "\n".join((tmp_path / f"host{k}.log").read_text()[-1500:] for k in range(3))
    assert code == 130 and all(c != "hung" for c in rest) and took < 40, (code, rest, took, logs)
    assert "Traceback" not in logs


# -- what a client may send (issue 42) ------------------------------------------------------------------------
def _health_latencies(url: str, stop: threading.Event, out: list) -> None:
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.get(url + "/health")
            out.append((time.perf_counter() - t0, r.status_code))
            time.sleep(0.01)


def test_huge_body_refused_fast_while_health_answers(server):
    """A 20 MiB body (declared, and chunked without a Content-Length) is refused with an OpenAI-style 413 without
    being read into memory or tokenised, while /health keeps answering; a long prompt within the body limit is
    refused by its length in characters before tokenising. (The old server read, parsed and tokenised it on the
    event loop: 15.6 s, /health and every stream waiting.) Timings on a loaded 2-core box: loose bounds here,
    the measured figures are printed."""
    big = json.dumps({"messages": [{"role": "user", "content": "a " * (10 << 20)}], "max_tokens": 4}).encode()
    assert len(big) > 20 << 20
    stop, lat = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(server.url, stop, lat))
    poller.start()
    try:
        time.sleep(0.2)
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/chat/completions", content=big, timeout=60,
                       headers={"content-type": "application/json"})
        declared_s = time.perf_counter() - t0

        def chunks():
            for i in range(0, len(big), 1 << 16):
                yield big[i:i + (1 << 16)]
        t0 = time.perf_counter()
        r2 = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=60,
                        headers={"content-type": "application/json"})
        chunked_s = time.perf_counter() - t0
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join(30)
    for resp in (r, r2):
        assert resp.status_code == 413, resp.text[:300]
        err = resp.json()["error"]
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error", err
    worst = max(t for t, _ in lat)
    print(f"\n20 MiB body refused in {declared_s:.3f} s (Content-Length) / {chunked_s:.3f} s (chunked); "
          f"/health worst {worst:.3f} s over {len(lat)} polls")
    assert declared_s < 3 and chunked_s < 5 and worst < 1.0 and all(c == 200 for _, c in lat)
    long = {"prompt": "word " * 200_000, "max_tokens": 4}   # 1 MB of text: under the body limit, over the chars
    t0 = time.perf_counter()
    r = post(server, "/v1/completions", long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "characters" in r.json()["error"]["message"] and time.perf_counter() - t0 < 3
    assert post(server, "/v1/completions", {"prompt": "A cat", "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize("raw", [
    b"[" * 100_000,                                                   # deeper than the JSON parser's recursion
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",               # valid JSON, nested 5000 deep
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b"\xff\xfe{}",                                                    # not UTF-8
    b"",
    b'{"prompt": "x", "' + b"k" * 5000 + b'": 1}',                   # a very long unknown field name
])
def test_malformed_json_of_any_depth_is_a_4xx_json_error(server, raw):
    """Every malformed body is a 4xx with an OpenAI-style JSON error (deep nesting used to escape as
    RecursionError: a plain-text 500 and a 70-line traceback in the log); the server keeps serving."""
    r = httpx.post(server.url + "/v1/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) < 300, err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_unknown_model_is_404_model_not_found(server):
    """As OpenAI and vLLM answer (was 400)."""
    for path, body in (("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"})):
        r = post(server, path, body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model", err


# -- SIGTERM: a graceful stop (issue 42) ----------------------------------------------------------------------
def _stream_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    """POST a streamed completion in a thread: ``out`` gets "first" (an Event set at the first content chunk),
    "events" (parsed SSE events) and "done" (the stream ended with [DONE])."""
    out["first"], out["events"], out["done"], out["error"] = threading.Event(), [], False, None

    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        e = json.loads(line[6:])
                        out["events"].append(e)
                        if e.get("choices") and e["choices"][0].get("text"):
                            out["first"].set()
        except httpx.HTTPError as e:
            out["error"] = repr(e)
        out["first"].set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _sigterm_server(stories_stages, tmp_path, grace: int) -> Server:
    return Server([f"model.stage_dir={stories_stages}", f"head_dir=oracle:{STORIES}", "comm.timeout_s=10",
                   "--stop-grace-s", str(grace)], tmp_path / "server.log")


def _final(out: dict) -> tuple[str, int]:
    """The stream's last finish_reason and its new_tokens."""
    return ([e["choices"][0]["finish_reason"] for e in out["events"] if e.get("choices")][-1],
            out["events"][-1]["speculative"]["new_tokens"])


def test_sigterm_finishes_the_request_in_flight_then_a_second_sigterm_stops_at_once(stories_stages, tmp_path):
    """SIGTERM to the launcher (was: the request in flight aborted with a 503), grace 60 s: new requests get 503
    while the requests in flight go on; a short one finishes whole ("length"/"stop"). The graceful stop is bounded
    by the operator too: a second SIGTERM while a long one is still in flight ends every rank at once (that request
    gets an error event or a cut stream), far sooner than --stop-grace-s; the launcher exits 143.

    One launch answers both claims (issue 43: was two, test_sigterm_..._in_flight[60] and test_second_sigterm_stops_
    at_once): the short and the long request run at once in two lanes (serve.max_active's default, 4), so the long
    one (400 tokens in naive mode: tens of seconds here) is still in flight when the short one (40) has finished."""
    s = _sigterm_server(stories_stages, tmp_path, 60)
    try:
        short, long = {}, {}
        tl = _stream_in_thread(s.url, {"prompt": "Once upon a time", "max_tokens": 400, "mode": "naive"}, long)
        ts = _stream_in_thread(s.url, {"prompt": "The little dog", "max_tokens": 40, "mode": "naive"}, short)
        for out in (long, short):
            assert out["first"].wait(120) and out["error"] is None, (out, s.log.read_text()[-2000:])
        os.kill(s.proc.pid, signal.SIGTERM)   # the launcher (run_serve.sh exec'ed it)
        time.sleep(0.5)
        try:
            late = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}, timeout=30)
            late_code = late.status_code
        except httpx.HTTPError:
            late_code = None   # the server had already finished and closed
        ts.join(120)
        assert not ts.is_alive() and s.proc.poll() is None and not long["done"], \
            ("the long request should still be in flight", _final(long) if long["events"] else None)
        t0 = time.monotonic()
        os.kill(s.proc.pid, signal.SIGTERM)   # the second one
        code = s.proc.wait(60)
        took = time.monotonic() - t0
        tl.join(30)
    finally:
        s.stop(signal.SIGKILL)
    log = s.log.read_text()
    assert short["done"] and short["error"] is None and short.get("status") == 200, (short, log[-2000:])
    assert not any("error" in e for e in short["events"]), (short["events"][-2:], log[-2000:])
    assert _final(short)[0] in ("length", "stop"), (_final(short), log[-2000:])
    assert late_code in (503, None), late_code
    assert code == 143 and took < 20, (code, took, log[-2000:])   # grace 60: the second SIGTERM did not wait
    assert "Traceback" not in log and "lost rank" not in log, log[-2000:]
    assert "[launch] stopped by SIGTERM" in log, log[-2000:]
    last = long["events"][-1] if long["events"] else {}
    assert "error" in last or long["error"] is not None or not long["done"], (last, log[-2000:])


def test_sigterm_with_grace_0_truncates_the_request_in_flight(stories_stages, tmp_path):
    """SIGTERM with --stop-grace-s 0: the request in flight ends at its next commit with finish_reason "cancelled";
    then every rank exits and the launcher says it was stopped (143) within a few seconds."""
    s = _sigterm_server(stories_stages, tmp_path, 0)
    try:
        out: dict = {}
        max_tokens = 400   # naive mode: tens of seconds on a loaded 2-core box
        t = _stream_in_thread(s.url, {"prompt": "Once upon a time", "max_tokens": max_tokens, "mode": "naive"}, out)
        assert out["first"].wait(120) and out["error"] is None, (out, s.log.read_text()[-2000:])
        t0 = time.monotonic()
        os.kill(s.proc.pid, signal.SIGTERM)
        t.join(120)
        code = s.proc.wait(30)
        took = time.monotonic() - t0
    finally:
        s.stop(signal.SIGKILL)
    log = s.log.read_text()
    assert out["done"] and out["error"] is None and out.get("status") == 200, (out, log[-2000:])
    assert not any("error" in e for e in out["events"]), (out["events"][-2:], log[-2000:])
    final, n = _final(out)
    assert final == "cancelled" and n < max_tokens, (final, n, log[-2000:])
    assert code == 143 and took < 20, (code, took, log[-2000:])
    assert "Traceback" not in log and "lost rank" not in log, log[-2000:]
    assert "[launch] stopped by SIGTERM" in log, log[-2000:]


def test_bad_server_flag_is_one_line_once(stories_stages):
    """A bad run_serve.sh flag: one line from the launcher, exit 2, before any rank starts (was: argparse's usage
    and error printed once per rank)."""
    for flag, needle in ((["--bogus"], "unrecognized arguments: --bogus"), (["--queue-size", "0"], "--queue-size"),
                         (["--max-body-bytes", "5"], "--max-body-bytes")):
        res = subprocess.run([str(REPO / "run_serve.sh"), f"model.stage_dir={stories_stages}", *flag], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        lines = [l for l in res.stderr.splitlines() if l.strip() and "Requirement already" not in l]
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert lines[0].startswith("[launch] error:") and needle in lines[0], res.stderr
        assert "usage:" not in res.stderr + res.stdout


class _Choice:
    """The surface of ``pipeline.serve.Request`` that ``changes_of`` reads."""

    def __init__(self) -> None:
        self.version, self.final, self._cond, self._waiters = 0, False, threading.Condition(), []

    def change(self, final: bool = False) -> None:
        self.final = final
        self.version += 1
        for loop, ev in list(self._waiters):
            loop.call_soon_threadsafe(ev.set)


def _stream_states(changes_of, script) -> list[tuple[bool, bool]]:
    """What a stream consumer sees: ``(a.final, b.final)`` read at every yield of ``changes_of([a, b])``, while
    ``script(a, b, k)`` changes the choices during the k-th yield (as a rank-0 thread may)."""
    a, b = _Choice(), _Choice()

    async def consume():
        seen = []
        async for _ in changes_of([a, b]):
            seen.append((a.final, b.final))
            script(a, b, len(seen))
        return seen
    return asyncio.run(consume())


def test_changes_of_yields_after_a_change_made_during_a_yield():
    from pipeline.serve import changes_of

    def script(a, b, k):   # the consumer has just read both; then both finish before it asks for more
        if k == 1:
            a.change(final=True)
            b.change(final=True)
    assert _stream_states(changes_of, script)[-1] == (True, True)   # the finish was seen: its chunk is sent

    async def ends_on_all_final_now(reqs):   # planted: the old rule (end as soon as all are final after a yield)
        seen = None
        while True:
            v = tuple(r.version for r in reqs)
            if v != seen:
                seen = v
                yield
                if all(r.final for r in reqs):
                    return
                continue
            if all(r.final for r in reqs):
                return
    assert _stream_states(ends_on_all_final_now, script)[-1] == (False, False)   # the lost finish chunk
