"""`numaov serve` with two exports at once: the tiny DeepSeek-V2 (dp=2, pinned workers) and a
tiny Wan 2.1 pipeline, with `--sync-videos` (the videos in the answer); images and videos
through the OpenAI-shaped routes, checked against the same generation run directly with
`run_wan_pipeline`; large bodies refused without holding up `/health`. The video jobs of the
default, asynchronous `/v1/videos` are test_video_jobs.py's."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from support.deepseek_harness import tiny_tokenizer
from support.service_harness import start_server, stop_server

from numaov.runtime.wan.pipeline import run_wan_pipeline
from numaov.runtime.wan.request import WanSampleRequest
from numaov.runtime.wan.video_output import to_uint8

pytestmark = pytest.mark.slow  # a real server with rank workers and a Wan pipeline

PROMPT, NEGATIVE = "a w1 w2 b", "w3 c"
STEPS = 2
# The server and this process run the same f32 graphs on the same machine, possibly with
# other thread partitions (the server shares its CPUs with the LM's workers): the frames
# agree to ~1e-6 before rounding, so at most one 8-bit level apart after it.
LEVELS = 1


BODY_LIMIT = 8_000_000
PROMPT_LIMIT = 511


@pytest.fixture(scope="module")
def served(deepseek_exported: dict[str, Any], wan_pipeline_exported: dict[str, Any],
           deepseek_bind: str, tmp_path_factory: pytest.TempPathFactory):
    tokenizer_dir = tmp_path_factory.mktemp("video_tokenizer")
    tiny_tokenizer(tokenizer_dir)
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind, "--model-dir",
                               str(wan_pipeline_exported["export"]), "--model-name", "lm",
                               "--sync-videos", "--tokenizer", str(tokenizer_dir),
                               "--max-body-bytes", str(BODY_LIMIT), "--max-prompt-tokens",
                               str(PROMPT_LIMIT))
    client = httpx.Client(base_url=url, timeout=600)
    try:
        yield {"url": url, "client": client, "export": wan_pipeline_exported["export"]}
    finally:
        client.close()
        stop_server(server)


def _direct(export: Path, tmp_path: Path, frames: int, seed: int, name: str) -> np.ndarray:
    request = WanSampleRequest(frames=frames, height=32, width=48, steps=STEPS, guidance=5.0,
                               seed=seed)
    result = run_wan_pipeline(export, request, PROMPT, tmp_path / name,
                              negative_prompt=NEGATIVE)
    return to_uint8(result.frames)


def _png_base64(width: int, height: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    assert int(np.max(np.abs(got.astype(int) - expected.astype(int)))) <= LEVELS


def test_both_models_are_listed(served) -> None:
    data = served["client"].get("/v1/models").json()["data"]
    assert [(m["id"], m["kind"]) for m in data] == [("lm", "language-model"),
                                                     ("export", "wan-pipeline")]
    health = served["client"].get("/health").json()
    assert health["status"] == "ok" and health["video"]["state"] == "ok"


def test_images_are_pngs_of_the_requested_size_equal_to_the_pipeline(served, tmp_path) -> None:
    from PIL import Image

    response = served["client"].post("/v1/images/generations", json={
        "prompt": PROMPT, "negative_prompt": NEGATIVE, "size": "48x32", "n": 2, "seed": 7,
        "steps": STEPS, "guidance": 5.0})
    assert response.status_code == 200, response.text
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))
              for d in response.json()["data"]]
    assert [(i.format, i.size) for i in images] == [("PNG", (48, 32))] * 2
    pixels = [np.asarray(i.convert("RGB")) for i in images]
    _close(pixels[0], _direct(served["export"], tmp_path, 1, 7, "seed7")[0])
    _close(pixels[1], _direct(served["export"], tmp_path, 1, 8, "seed8")[0])  # choice 1: seed+1


def test_videos_decode_to_the_requested_size_and_frames(served, tmp_path) -> None:
    import av
    from PIL import Image, ImageSequence

    client = served["client"]
    response = client.post("/v1/videos", json={
        "prompt": PROMPT, "negative_prompt": NEGATIVE, "size": "48x32", "frames": 5,
        "seed": 3, "steps": STEPS, "response_format": "url"})
    assert response.status_code == 200, response.text
    job = response.json()
    assert (job["object"], job["status"], job["size"], job["frames"]) == (
        "video", "completed", "48x32", 5)
    mp4 = client.get(job["data"][0]["url"])
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(mp4.content)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
    # animated WebP is lossless: the frames themselves
    response = client.post("/v1/videos", json={
        "prompt": PROMPT, "negative_prompt": NEGATIVE, "size": "48x32", "seconds": "0.5",
        "seed": 3, "steps": STEPS, "format": "webp"})
    assert response.status_code == 200, response.text
    assert response.json()["frames"] == 9  # 0.5 s at 16 frames/s, as 4k+1 frames
    webp = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    got = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(webp)])
    _close(got, _direct(served["export"], tmp_path, 9, 3, "v.webp"))


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/images/generations", {"prompt": PROMPT, "size": "50x32"}, "size", "multiple of 16"),
    ("/v1/images/generations", {"prompt": PROMPT, "size": "big"}, "size", "WIDTHxHEIGHT"),
    ("/v1/images/generations", {"prompt": PROMPT, "n": 5}, "n", "from 1 to 4"),
    ("/v1/images/generations", {"prompt": ""}, "prompt", "non-empty text"),
    ("/v1/images/generations", {"prompt": PROMPT, "style": "vivid", "colour": 1}, "colour",
     "unknown field"),
    ("/v1/videos", {"prompt": PROMPT, "frames": 6}, "frames", "4k\\+1 frames"),
    ("/v1/videos", {"prompt": PROMPT, "frames": 1000}, "frames",
     "4k\\+1 frames up to 129: 1, 5, 9, ..., 129"),
    ("/v1/videos", {"prompt": PROMPT, "steps": 1000}, "steps", "from 1 to 100"),
    ("/v1/videos", {"prompt": PROMPT, "format": "avi"}, "format", "mp4, webp"),
    ("/v1/videos", {"prompt": PROMPT, "model": "sora-2"}, "model", "not served here"),
    ("/v1/videos", {"prompt": PROMPT, "input_reference": "a photo"}, "input_reference",
     "expected a PNG, JPEG or WebP image as base64"),
    ("/v1/videos", {"prompt": PROMPT, "size": "48x32", "input_reference": _png_base64(48, 32)},
     "input_reference", "has no image conditioning"),
])
def test_bad_video_requests_name_the_field(served, path: str, body: dict, param: str,
                                           message: str) -> None:
    import re

    response = served["client"].post(path, json={**body, "steps": body.get("steps", 1)})
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error


def test_language_model_and_images_served_side_by_side(served) -> None:
    client = served["client"]

    def chat(i: int) -> list[int]:
        r = client.post("/v1/completions", json={"prompt": [5 + i, 6], "max_tokens": 4})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def image(seed: int) -> str:
        r = client.post("/v1/images/generations", json={"prompt": PROMPT, "size": "48x32",
                                                        "seed": seed, "steps": 1})
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["b64_json"]

    alone = [chat(i) for i in range(6)], [image(s) for s in (1, 2)]
    with ThreadPoolExecutor(8) as pool:
        images = [pool.submit(image, s) for s in (1, 2)]
        chats = [pool.submit(chat, i) for i in range(6)]
        together = [c.result() for c in chats], [i.result() for i in images]
    assert together[0] == alone[0]
    assert together[1] == alone[1]


def test_each_graph_is_compiled_once_for_the_servers_life(served) -> None:
    client = served["client"]

    def image(seed: int) -> int:
        response = client.post("/v1/images/generations", json={
            "prompt": PROMPT, "size": "48x32", "seed": seed, "steps": STEPS})
        assert response.status_code == 200, response.text
        return client.get("/health").json()["video"]["compiled_graphs"]

    kept = image(3)
    assert kept >= 3  # at least the text encoder, the transformer and the VAE's first frame
    assert image(4) == kept  # the second generation compiled nothing


def _noise_png_base64(width: int, height: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_large_bodies_are_refused_without_holding_up_health(served) -> None:
    """A 4 MB prompt (as a completion and as a chat message) and a 4 MB image reference,
    refused while /health is polled: every /health answers. How long they took is printed,
    not judged (this machine's speed moves 2x); that the parses leave the event loop free
    is test_request_bodies.py's, shown without timing."""
    client, url = served["client"], served["url"]
    words = " ".join(f"w{10 + i % 400}" for i in range(800_000))[:4_000_000]  # ~800k tokens
    image = _noise_png_base64(1100, 900)
    assert 3_500_000 < len(image) < BODY_LIMIT
    bodies = [("/v1/completions", {"prompt": words, "max_tokens": 1}, "prompt"),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}]},
               "messages"),
              ("/v1/videos", {"prompt": PROMPT, "size": "48x32", "input_reference": image},
               "input_reference")]
    encoded = [(path, json.dumps(body).encode(), param) for path, body, param in bodies]
    answers: dict[str, httpx.Response] = {}

    def refuse(path: str, content: bytes) -> None:
        with httpx.Client(base_url=url, timeout=120) as own:
            answers[path] = own.post(path, content=content,
                                     headers={"content-type": "application/json"})

    latencies: list[float] = []
    for _ in range(3):  # warm: connections open, routes imported
        client.get("/health")
    threads = [threading.Thread(target=refuse, args=(path, content))
               for path, content, _ in encoded]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        start = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    for path, _, param in encoded:
        assert answers[path].status_code == 400, answers[path].text
        assert answers[path].json()["error"]["param"] == param
    assert "the prompt has more than" in answers["/v1/completions"].json()["error"]["message"]
    print(f"/health while refusing: {len(latencies)} answers, max "
          f"{max(latencies) * 1000:.1f} ms, median {np.median(latencies) * 1000:.1f} ms")
