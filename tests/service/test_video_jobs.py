"""Video jobs as OpenAI's video API runs them, on a real `numaov serve` of the tiny Wan 2.1
pipeline export, driven with the official `openai` client: create, poll (progress rising),
download (the video and its thumbnail), list, delete; a job deleted mid-run frees its memory
(the worker's resident memory, measured) and the next one runs; the memory budget; the
bounded result store; a client that leaves a synchronous image request cancels it; SIGTERM
during a long video is a bounded stop, a second signal an immediate one."""

from __future__ import annotations

import io
import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.service_harness import (
    children,
    shared_memory_of,
    start_server,
    stop_server,
)

slow = pytest.mark.slow  # a real server with its video worker process
# The openai client's videos resource warns of the Sora API's end on every call.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

PROMPT = "a w1 w2 b"
SMALL = {"prompt": PROMPT, "size": "48x32", "frames": 5, "steps": 2, "seed": 3}
# About 1.4 GiB by the estimate, most of it the VAE's caches, working memory and frames: the
# worker's memory grows by hundreds of MB while the VAE decodes (10 s or more here).
LONG = {"prompt": PROMPT, "size": "512x512", "frames": 33, "steps": 4, "seed": 1}
RESULTS = 3
BUDGET = "2G"


def _openai(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def served(wan_pipeline_exported: dict[str, Any]):
    server, url = start_server(wan_pipeline_exported["export"], "", "--video-results",
                               str(RESULTS), "--video-memory", BUDGET)
    client = httpx.Client(base_url=url, timeout=120)
    try:
        yield {"url": url, "client": client, "server": server, "openai": _openai(url),
               "export": wan_pipeline_exported["export"]}
    finally:
        client.close()
        stop_server(server)


def _anon_rss_mb(pid: int) -> float:
    """Anonymous resident memory (what a job allocates; shared libraries left out), MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def _tree(pid: int) -> list[int]:
    out = [pid]
    for child in children(pid):
        out += _tree(child)
    return out


def _tree_rss_mb(pid: int) -> float:
    return sum(_anon_rss_mb(p) for p in _tree(pid))


def _wait(predicate, what: str, timeout_s: float = 120.0, every_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def _finished(client: Any, video_id: str, timeout_s: float = 300) -> Any:
    return _wait(lambda: (lambda v: v if v.status in ("completed", "failed") else None)(
        client.videos.retrieve(video_id)), f"video {video_id} to finish", timeout_s, 0.2)


@slow
def test_create_poll_download_list_delete_with_the_openai_client(served) -> None:
    import av
    from PIL import Image

    client = served["openai"]
    created = client.videos.create(prompt=PROMPT, size="48x32", seconds="1",
                                   extra_body={"steps": 6, "seed": 5, "format": "mp4"})
    assert created.object == "video" and created.status in ("queued", "in_progress")
    assert (created.size, created.seconds, created.progress) == ("48x32", "1", 0)
    assert created.model == "export" and created.completed_at is None
    seen = []
    video = _wait(lambda: (lambda v: seen.append((v.status, v.progress)) or (
        v if v.status in ("completed", "failed") else None))(client.videos.retrieve(created.id)),
        "the video", 300, 0.05)
    assert video.status == "completed", video.error
    progress = [p for _, p in seen]
    assert progress == sorted(progress) and progress[-1] == 100  # it only rises
    assert any(s == "in_progress" and 0 < p < 100 for s, p in seen), seen
    assert video.completed_at >= video.created_at and video.expires_at > video.completed_at
    assert video.model_extra["frames"] == 17  # 1 s at 16 frames/s, as 4k+1 frames
    mp4 = client.videos.download_content(created.id).content
    with av.open(io.BytesIO(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 17 and frames[0].shape == (32, 48, 3)
    thumbnail = client.videos.download_content(created.id, variant="thumbnail").content
    assert Image.open(io.BytesIO(thumbnail)).size == (48, 32)
    assert created.id in [v.id for v in client.videos.list()]
    deleted = client.videos.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "video.deleted")
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        client.videos.retrieve(created.id)


@slow
def test_a_guidance_free_few_step_job_takes_the_scheduler_shift_and_cache(served) -> None:
    """As `run wan --guidance 1 --scheduler euler --shift 5 --cache first-block:0.3` (a
    distilled LoRA's recipe, cached): the job runs with them and says so; the settings are
    checked at creation."""
    from openai import BadRequestError

    client = served["openai"]
    created = client.videos.create(prompt=PROMPT, size="48x32", seconds="1", extra_body={
        "steps": 4, "guidance": 1, "scheduler": "euler", "shift": 5.0, "seed": 3,
        "cache": "first-block:0.3"})
    video = _finished(client, created.id)
    assert video.status == "completed", video.error
    assert (video.model_extra["scheduler"], video.model_extra["shift"]) == ("euler", 5.0)
    assert video.model_extra["guidance"] == 1
    assert video.model_extra["cache"] == "first-block:0.3"
    for extra, param, needle in (
            ({"scheduler": "ddim"}, "scheduler", "ddim"), ({"shift": 0}, "shift", "shift"),
            ({"cache": "teacache"}, "cache", "expected first-block"),
            ({"cache": "magcache"}, "cache", "lacks (measured once on the server"),
            ({"cache": "magcache:calibrate"}, "cache", "measures the ratios into the served"),
            ({"cache": 0.1}, "cache", "expected first-block"),
            ({"guidance": 1, "negative_prompt": "blur"}, "negative_prompt", "guidance 1")):
        with pytest.raises(BadRequestError) as caught:
            client.videos.create(prompt=PROMPT, size="48x32", seconds="1", extra_body=extra)
        assert caught.value.body["param"] == param, caught.value.body
        assert needle in caught.value.body["message"], caught.value.body


@slow
def test_a_form_upload_is_read_as_openai_sends_it(served) -> None:
    from openai import BadRequestError
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 30, 90)).save(buffer, format="PNG")
    with pytest.raises(BadRequestError) as refused:  # the file arrived, and was read
        served["openai"].videos.create(prompt=PROMPT, size="48x32",
                                       input_reference=("first.png", buffer.getvalue(),
                                                        "image/png"))
    error = refused.value.body
    assert error["param"] == "input_reference" and "no image conditioning" in error["message"]
    response = served["client"].post("/v1/videos", files={"prompt": (None, PROMPT),
                                                          "steps": (None, "lots")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "steps"


@slow
def test_a_job_deleted_mid_run_frees_its_memory_and_the_next_one_runs(served) -> None:
    client, server = served["client"], served["server"]
    warm = client.post("/v1/videos", json=SMALL).json()  # graphs compiled, worker settled
    assert _finished(served["openai"], warm["id"]).status == "completed"
    baseline = _tree_rss_mb(server.proc.pid)
    worker = client.get("/health").json()["video"]["worker"]["pid"]
    job = client.post("/v1/videos", json=LONG).json()
    # Past the denoising steps, the VAE decodes: the worker holds its caches and frames.
    peak = _wait(lambda: (lambda m: m if m > baseline + 250 else None)(
        _tree_rss_mb(server.proc.pid)), "the job's memory to grow", 300, 0.05)
    assert client.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"
    start = time.perf_counter()
    deleted = client.delete(f"/v1/videos/{job['id']}")
    seconds = time.perf_counter() - start
    assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert not _alive(worker)
    after = _tree_rss_mb(server.proc.pid)
    print(f"anon RSS: baseline {baseline:.0f} MB, during {peak:.0f} MB, after delete "
          f"{after:.0f} MB; DELETE answered in {seconds:.2f} s")
    assert after < baseline + 100 and seconds < 5
    assert client.get(f"/v1/videos/{job['id']}").status_code == 404
    following = client.post("/v1/videos", json=SMALL).json()
    assert _finished(served["openai"], following["id"]).status == "completed"


@slow
def test_a_job_above_the_memory_budget_is_refused_with_the_numbers(served) -> None:
    response = served["client"].post("/v1/videos", json={
        "prompt": PROMPT, "size": "1280x704", "frames": 129, "steps": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "size" and error["code"] == "insufficient_memory"
    assert "GiB" in error["message"] and "2.00 GiB (--video-memory)" in error["message"], error


@slow
def test_a_size_the_pipeline_does_not_take_is_refused_at_creation(served) -> None:
    response = served["client"].post("/v1/videos", json={**SMALL, "size": "50x32"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "size"
    assert "multiple of 16" in response.json()["error"]["message"]


@slow
def test_a_queued_job_can_be_deleted_and_the_list_pages(served) -> None:
    client, openai = served["client"], served["openai"]
    first = client.post("/v1/videos", json={**SMALL, "steps": 20}).json()
    queued = client.post("/v1/videos", json=SMALL).json()
    assert client.get(f"/v1/videos/{queued['id']}").json()["status"] == "queued"
    early = client.get(f"/v1/videos/{queued['id']}/content")  # not ready: OpenAI's 404
    assert early.status_code == 404 and early.json()["error"]["code"] == "not_completed"
    assert client.delete(f"/v1/videos/{queued['id']}").json()["deleted"] is True
    last = client.post("/v1/videos", json=SMALL).json()
    for video in (first, last):
        assert _finished(openai, video["id"]).status == "completed"
    page = client.get("/v1/videos", params={"limit": 1}).json()
    assert [v["id"] for v in page["data"]] == [last["id"]] and page["has_more"]
    following = client.get("/v1/videos", params={"limit": 1, "after": last["id"]}).json()
    assert following["data"][0]["id"] == first["id"]
    # a cursor deleted since its page still places the next one (the client pages on)
    assert client.delete(f"/v1/videos/{last['id']}").json()["deleted"] is True
    following = client.get("/v1/videos", params={"limit": 1, "after": last["id"]}).json()
    assert following["data"][0]["id"] == first["id"]
    unknown = client.get("/v1/videos", params={"after": "video_nope"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "after"
    ascending = [v.id for v in openai.videos.list(order="asc")]
    assert first["id"] in ascending and last["id"] not in ascending
    assert queued["id"] not in ascending
    bad = client.get("/v1/videos", params={"limit": 0, "colour": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "colour"


@slow
def test_the_store_keeps_the_last_results_only(served) -> None:
    client, openai = served["client"], served["openai"]
    made = []
    for seed in range(RESULTS + 1):
        made.append(client.post("/v1/videos", json={**SMALL, "seed": seed}).json()["id"])
        assert _finished(openai, made[-1]).status == "completed"
    assert client.get(f"/v1/videos/{made[0]}").status_code == 404  # the oldest went first
    assert all(client.get(f"/v1/videos/{i}/content").status_code == 200 for i in made[1:])
    store = client.get("/health").json()["video"]["results"]
    assert store["count"] == RESULTS


@slow
def test_a_client_that_leaves_a_synchronous_request_cancels_it(served) -> None:
    client, url = served["client"], served["url"]
    starts = client.get("/health").json()["video"]["worker"]["starts"]
    # the request is sent whole, the connection closed once the image is being made (a
    # timeout would race a warm worker that makes it within the timeout)
    body = json.dumps({"prompt": PROMPT, "size": "832x480", "steps": 100}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    _wait(lambda: client.get("/health").json()["video"]["running"] == 1, "the image to start",
          60, 0.02)
    sock.close()
    health = _wait(lambda: (lambda h: h if h["running"] == 0 and h["worker"]["pid"] else None)(
        client.get("/health").json()["video"]), "the image to be cancelled", 30)
    assert health["worker"]["starts"] == starts + 1  # its worker was stopped, a fresh one runs


# -- stopping ---------------------------------------------------------------------------------


def _stalled_upload(url: str) -> socket.socket:
    """A request whose body never finishes arriving: it holds a graceful stop's drain."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    return sock


def _exit_seconds(server: Any, since: float, timeout_s: float = 60) -> float:
    server.proc.wait(timeout=timeout_s)
    return time.monotonic() - since


@pytest.mark.parametrize("second", [None, signal.SIGTERM, signal.SIGINT])
@slow
def test_sigterm_during_a_long_video_is_a_bounded_stop(wan_pipeline_exported, second) -> None:
    bound = 8.0
    server, url = start_server(wan_pipeline_exported["export"], "", "--shutdown-timeout",
                               str(bound))
    client = httpx.Client(base_url=url, timeout=60)
    job = client.post("/v1/videos", json={**LONG, "steps": 100}).json()
    _wait(lambda: client.get(f"/v1/videos/{job['id']}").json()["progress"] > 0,
          "the video to run", 120)
    processes = _tree(server.proc.pid)
    upload = _stalled_upload(url)
    time.sleep(0.5)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    if second is not None:
        server.wait_for("stopping: no new requests", 10)
        time.sleep(0.5)
        assert server.proc.poll() is None  # the stalled upload holds the drain
        server.proc.send_signal(second)
    seconds = _exit_seconds(server, start)
    upload.close()
    client.close()
    output = server.rest_of_output(10)
    print(f"stopped {seconds:.2f} s after the first SIGTERM (second: {second})")
    assert server.proc.returncode == 0 and "Traceback" not in output, output
    assert "numaov serve: stopped" in output
    if second is None:  # the drain waits for the stalled upload, to its end
        assert bound / 2 <= seconds < bound, output
    else:
        assert seconds < 3, output
        assert "stopping now" in output
    _wait(lambda: not [p for p in processes if _alive(p)], "the workers to exit", 5)
    assert shared_memory_of(server.proc.pid) == []


@slow
def test_a_second_signal_stops_at_once_with_lm_streams_in_flight(
        deepseek_exported: dict[str, Any], wan_pipeline_exported: dict[str, Any],
        deepseek_bind: str) -> None:
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind, "--model-dir",
                               str(wan_pipeline_exported["export"]), "--max-running", "1")
    client = httpx.Client(base_url=url, timeout=60)
    job = client.post("/v1/videos", json={**LONG, "steps": 100}).json()
    _wait(lambda: client.get(f"/v1/videos/{job['id']}").json()["progress"] > 0,
          "the video to run", 120)
    processes = _tree(server.proc.pid)
    streams = [httpx.Client(base_url=url, timeout=60) for _ in range(4)]
    opened = [s.stream("POST", "/v1/completions", json={
        "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True})
        for s in streams]
    responses = [o.__enter__() for o in opened]
    assert all(r.status_code == 200 for r in responses)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.send_signal(signal.SIGINT)
    seconds = _exit_seconds(server, start)
    for s in streams:
        s.close()
    output = server.rest_of_output(10)
    print(f"stopped {seconds:.2f} s after SIGTERM + SIGINT")
    assert server.proc.returncode == 0 and "Traceback" not in output, output
    assert seconds < 5, output
    _wait(lambda: not [p for p in processes if _alive(p)], "the workers to exit", 5)
    assert shared_memory_of(server.proc.pid) == []


# -- the parts, without a server --------------------------------------------------------------


@slow
def test_finished_jobs_expire_and_the_store_is_bounded_by_bytes(wan_pipeline_exported) -> None:
    from numaov.runtime.service.video_requests import VIDEO_FIELDS, VideoLimits, parse_video_job
    from numaov.runtime.service.video_service import (
        COMPLETED,
        Output,
        ResultLimits,
        VideoService,
    )

    service = VideoService(wan_pipeline_exported["export"], "export",
                           results=ResultLimits(count=8, bytes=1000, ttl_s=0.5))
    job = parse_video_job(SMALL, True, VideoLimits(), VIDEO_FIELDS)

    def made(size: int) -> str:  # as the dispatcher finishes one (no worker here)
        generation = service.create(job, "video", max_queue=8)
        with service._cond:
            service._queue.remove(generation)
            generation.outputs = [Output(b"x" * size, "video/mp4")]
            service._finish(generation, COMPLETED)
        return generation.id

    first, second = made(600), made(300)
    assert service.get(first) is not None
    third = made(300)  # 1200 bytes: the oldest goes
    assert service.get(first) is None and service.get(second) is not None
    too_big = service.get(made(2000))
    assert too_big.status == "failed" and too_big.error["code"] == "result_too_large"
    time.sleep(0.6)
    assert service.get(second) is None and service.get(third) is None  # expired
    assert service.listing() == []


def test_a_form_is_read_into_fields() -> None:
    from numaov.runtime.service.errors import RequestError
    from numaov.runtime.service.http_common import parse_form
    from numaov.runtime.service.video_requests import form_values

    request = httpx.Request("POST", "http://x/v1/videos", data={
        "prompt": "héllo", "steps": "3", "guidance": "4.5", "seed": "x",
        "input_reference[image_url]": "data:image/png;base64,AAAA"},
        files={"other": ("a.png", b"\x89PNG\r\n\x00\xff", "image/png")})
    body = request.read()
    fields = parse_form(body, request.headers["content-type"])
    assert fields["other"] == b"\x89PNG\r\n\x00\xff"
    assert fields["input_reference"] == {"image_url": "data:image/png;base64,AAAA"}
    assert form_values(fields)["steps"] == 3 and form_values(fields)["guidance"] == 4.5
    assert form_values(fields)["seed"] == "x"  # left as text: its check names it
    with pytest.raises(RequestError, match="not readable multipart"):
        parse_form(body[:-10], request.headers["content-type"])


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"size": "²x32"}, "size", 'size is "²x32"'),  # str.isdigit() takes "²", int() does not
    ({"seconds": "²"}, "seconds", 'seconds is "²"'),
    ({"seconds": float("inf")}, "seconds", "seconds is Infinity"),
    ({"seconds": float("nan")}, "seconds", "seconds is NaN"),
    ({"guidance": float("nan")}, "guidance", "guidance is NaN; expected a number >= 1"),
    ({"guidance": "nan"}, "guidance", "guidance is NaN"),  # a form field's text
    ({"steps": "٣"}, "steps", 'steps is "٣"'),
    ({"format": ["mp4"]}, "format", 'format is \\["mp4"\\]'),
    ({"size": b"48x32"}, "size", "size is a file of 5 bytes"),  # a text field sent as a file
])
def test_odd_values_are_400s_naming_the_field(body: dict, param: str, message: str) -> None:
    """Values that once got past the checks into a 500 (or, NaN guidance, into a job that
    failed later naming another field)."""
    from numaov.runtime.service.errors import RequestError
    from numaov.runtime.service.video_requests import (
        VIDEO_FIELDS,
        VideoLimits,
        form_values,
        parse_video_job,
    )

    with pytest.raises(RequestError, match=message) as caught:
        parse_video_job(form_values({"prompt": "a cat", **body}), True, VideoLimits(),
                        VIDEO_FIELDS)
    assert caught.value.status == 400 and caught.value.param == param


def test_every_served_model_gets_its_own_id(monkeypatch, tmp_path) -> None:
    from types import SimpleNamespace

    from numaov import NumaovError
    from numaov.cli import _served_models
    from numaov.manifest import LM_KIND, PIPELINE_KIND

    kinds = {"deepseek": LM_KIND, "wan": PIPELINE_KIND}
    monkeypatch.setattr("numaov.runtime.manifest_reader.read_manifest", lambda d: SimpleNamespace(
        kind=kinds[Path(d).parent.name]))
    lm, wan = str(tmp_path / "deepseek" / "model"), str(tmp_path / "wan" / "model")
    assert _served_models([lm, wan], []) == {"lm": (lm, "deepseek/model"),
                                             "video": (wan, "wan/model")}
    assert _served_models([lm, wan], ["chat"]) == {"lm": (lm, "chat"), "video": (wan, "model")}
    assert _served_models([lm, wan], ["chat", "video"])["video"] == (wan, "video")
    with pytest.raises(NumaovError, match="repeat a name"):
        _served_models([lm, wan], ["same", "same"])
    with pytest.raises(NumaovError, match="at most one name per model directory"):
        _served_models([lm], ["a", "b"])


def test_a_long_prompt_is_refused_from_a_prefix() -> None:
    from numaov.runtime.service.errors import RequestError
    from numaov.runtime.service.lm_requests import PREFIX_CHARS_PER_TOKEN, encode_bounded

    seen = []

    def encode(text: str) -> list[int]:
        seen.append(len(text))
        return [1] * len(text.split())

    text = "w1 " * 1_000_000  # 3 MB, a million tokens
    with pytest.raises(RequestError, match="more than 511 tokens"):
        encode_bounded(encode, text, 511, "prompt")
    assert seen == [511 * PREFIX_CHARS_PER_TOKEN]  # only the prefix was tokenized
    assert encode_bounded(encode, "w1 w2", 511, "prompt") == [1, 1]


def test_a_prompt_of_long_tokens_is_refused_from_growing_prefixes() -> None:
    """More characters a token than the first prefix allows for (a run of 100-character
    "words", each one token): the prefix doubles until it holds too many tokens, and the
    4 MB text is never tokenized whole."""
    from numaov.runtime.service.errors import RequestError
    from numaov.runtime.service.lm_requests import PREFIX_CHARS_PER_TOKEN, encode_bounded

    seen = []

    def encode(text: str) -> list[int]:
        seen.append(len(text))
        return [1] * len(text.split())

    text = ("x" * 99 + " ") * 40_000  # 4 MB, 40,000 tokens of 100 characters
    with pytest.raises(RequestError, match="more than 511 tokens"):
        encode_bounded(encode, text, 511, "prompt")
    first = 511 * PREFIX_CHARS_PER_TOKEN
    assert seen == [first, 2 * first, 4 * first]
    assert encode_bounded(encode, "x" * 99 + " w2", 511, "prompt") == [1, 1]
