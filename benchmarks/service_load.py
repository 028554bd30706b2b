"""numaov serve under load: continuous batching against one request at a time, same server.

Two ``numaov serve`` processes over the same export run side by side, idle between their
turns: ``batching`` (the default ``--max-running``) and ``one-at-a-time``
(``--max-running 1``: the rank takes the next request only when the last one finished). For
every round, every concurrency (1, 4, 16) and both servers in turn, clients (one asyncio loop
of httpx streams, in this process) send streamed ``/v1/completions`` of ``PROMPT_TOKENS``
seeded token ids and ``NEW_TOKENS`` new tokens (end-of-sequence ignored), ``REQUESTS[c]``
requests at concurrency ``c``, each client sending its next request when its last one ended.
Measured per run: requests/s and output tokens/s (over the run's wall time), time to first
token (request sent -> first token's chunk) and latency (-> ``[DONE]``), p50 and p99.

The Wan part: a tiny Wan 2.1 pipeline (``tests/support/wan_pipeline_harness.py``) exported and served
by a third server; ``VIDEOS`` video jobs of ``VIDEO_FRAMES`` frames at ``VIDEO_SIZE``, 2 at a
time (each created, polled until completed, its file downloaded), give videos per minute.

The mixed part (with the Wan part): one server with both exports; LM streams at concurrency
``MIXED_CONCURRENCY`` (``MIXED_REQUESTS`` of them, as above) alone, then while video jobs of
``MIXED_VIDEO`` run one after another (the next created when the last completed), in
alternating order per round. Measured: the LM's time to first token p99 with the videos over
without (the goal: under 2x), and video jobs per minute meanwhile.

The chat part (``--chat``, on the ``bench`` model: its prompts need 8,192 positions): two
servers over the same export, the prefix cache on (the default) and ``--no-prefix-cache``, in
alternating rounds. ``CHAT_CONVERSATIONS`` conversations at once, each sending
``CHAT_TURNS`` turns one after another: every turn's prompt is a ``CHAT_SYSTEM_TOKENS``-token
system prompt shared by all conversations, the conversation's history (its earlier user turns
and the server's answers, as a chat client resends them) and a new ``CHAT_USER_TOKENS``-token
user turn, answered with ``CHAT_NEW_TOKENS`` tokens. Measured per server: time to first token
of first turns and of later turns (medians), output tokens/s over the run, and the cached
prompt tokens the responses report (``usage.prompt_tokens_details.cached_tokens``).

Figures go to ``benchmarks/out/service_load.json`` (``service_load_chat.json`` for
``--chat``); ``benchmarks/RESULTS.md`` records them.

    .venv/bin/python benchmarks/service_load.py [--model tiny|bench] [--rounds 3] [--no-video]
    .venv/bin/python benchmarks/service_load.py --chat [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from machine import cpu_model  # benchmarks/machine.py, beside this file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out" / "service_load.json"
WORK = HERE / "out" / "service_load"
SEED = 0
PROMPT_TOKENS = 16
NEW_TOKENS = 64
CONCURRENCY = (1, 4, 16)
REQUESTS = {1: 6, 4: 16, 16: 48}
VIDEOS = 6
VIDEO_FRAMES = 9
VIDEO_SIZE = "48x32"
VIDEO_STEPS = 4
MIXED_CONCURRENCY = 8
MIXED_REQUESTS = 64
MIXED_VIDEO = {"size": "256x256", "frames": 17, "steps": 4}
BIND = "0-1"  # dp=1: one rank on both cores
CHAT_OUT = HERE / "out" / "service_load_chat.json"
CHAT_SYSTEM_TOKENS = 2000
CHAT_TURNS = 8
CHAT_USER_TOKENS = 24
CHAT_NEW_TOKENS = 24
CHAT_CONVERSATIONS = 16
# every conversation's history fits beside the others' (no waiting for slots, either server)
CHAT_CACHE_TOKENS = CHAT_CONVERSATIONS * (
    CHAT_SYSTEM_TOKENS + CHAT_TURNS * (CHAT_USER_TOKENS + CHAT_NEW_TOKENS)) + 4096


def log(message: str) -> None:
    print(f"[service_load] {message}", file=sys.stderr, flush=True)


def load_average() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def cli(*args: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "numaov.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)


def export_lm(model: str) -> tuple[Path, int]:
    """The export (dp=1) and its vocabulary size."""
    sys.path.insert(0, str(HERE))
    out = WORK / f"lm_{model}"
    if model == "tiny":
        checkpoint = WORK / "checkpoint_tiny"
        if not (checkpoint / "config.json").is_file():
            from numaov.models.builtin.deepseek_tiny import build_tiny_deepseek

            log("building the tiny checkpoint")
            build_tiny_deepseek(checkpoint, seed=SEED)
    else:
        from lm_checkpoints import build  # benchmarks/lm_checkpoints.py: 537 MB, cached

        checkpoint = build("deepseek_v2")
    if not (out / "manifest.json").is_file():
        log(f"exporting the {model} model (dp=1)")
        cli("export", "lm", "--checkpoint", str(checkpoint), "--dp", "1", "--out",
            str(out), "--force", env={"NUMAOV_CPU_BIND": BIND})
    config = json.loads((out / "manifest.json").read_text())["config"]
    return out, int(config["vocab_size"])


def export_wan() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    out = WORK / "wan"
    if not (out / "manifest.json").is_file():
        from support.wan_pipeline_harness import build_tiny_pipeline

        log("building and exporting the tiny Wan pipeline")
        build_tiny_pipeline(WORK / "wan_pipeline", seed=SEED)
        cli("export", "wan", "--checkpoint", str(WORK / "wan_pipeline"), "--out", str(out),
            "--force", "--quiet")
    return out


class Server:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "numaov.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "NUMAOV_CPU_BIND": BIND})
        for line in self.proc.stdout:
            match = re.search(r"on (http://[\d.]+:\d+)", line)
            if match:
                self.url = match.group(1)
                break
        else:
            raise SystemExit(f"the server did not start: {self.proc.returncode}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


async def lm_run(url: str, concurrency: int, prompts: list[list[int]]) -> dict[str, Any]:
    """``len(prompts)`` streamed requests, ``concurrency`` clients; the run's figures."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttft, latency, tokens = [], [], 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True,
                    "stream": True}
            sent, first = time.perf_counter(), None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ids = json.loads(line[6:])["choices"][0]["token_ids"]
                    if ids and first is None:
                        first = time.perf_counter()
                    tokens += len(ids)
            ttft.append(first - sent)
            latency.append(time.perf_counter() - sent)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    assert tokens == NEW_TOKENS * len(prompts), tokens
    return {"requests": len(prompts), "wall_s": wall, "requests_per_s": len(prompts) / wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "latency_p50_s": percentile(latency, 50),
            "latency_p99_s": percentile(latency, 99)}


async def video_job(http: httpx.AsyncClient, body: dict[str, Any]) -> bytes:
    """One video job: created, polled until completed, its file downloaded."""
    response = await http.post("/v1/videos", json={"prompt": "a w1 w2 b", **body})
    assert response.status_code == 200, response.text
    video = response.json()
    while video["status"] in ("queued", "in_progress"):
        await asyncio.sleep(0.05)
        video = (await http.get(f"/v1/videos/{video['id']}")).json()
    assert video["status"] == "completed", video
    content = await http.get(f"/v1/videos/{video['id']}/content")
    assert content.status_code == 200
    await http.delete(f"/v1/videos/{video['id']}")
    return content.content


async def video_run(url: str, count: int, concurrency: int) -> dict[str, Any]:
    async def one(i: int, http: httpx.AsyncClient) -> float:
        sent = time.perf_counter()
        await video_job(http, {"size": VIDEO_SIZE, "frames": VIDEO_FRAMES,
                               "steps": VIDEO_STEPS, "seed": i})
        return time.perf_counter() - sent

    semaphore = asyncio.Semaphore(concurrency)

    async def bounded(i: int, http: httpx.AsyncClient) -> float:
        async with semaphore:
            return await one(i, http)

    async with httpx.AsyncClient(base_url=url, timeout=1200) as http:
        start = time.perf_counter()
        latencies = await asyncio.gather(*(bounded(i, http) for i in range(count)))
        wall = time.perf_counter() - start
    return {"videos": count, "wall_s": wall, "videos_per_minute": 60 * count / wall,
            "latency_p50_s": percentile(list(latencies), 50)}


async def mixed_run(url: str, prompts: list[list[int]], videos: bool) -> dict[str, Any]:
    """``lm_run`` at ``MIXED_CONCURRENCY``, alone or while video jobs run back to back."""
    done = 0
    stop = asyncio.Event()

    async def video_loop() -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=1200) as http:
            while not stop.is_set():
                await video_job(http, {**MIXED_VIDEO, "seed": done})
                done += 1

    task = asyncio.ensure_future(video_loop()) if videos else None
    if task is not None:
        await asyncio.sleep(2.0)  # the first job past its start: the worker computing
    start = time.perf_counter()
    run = await lm_run(url, MIXED_CONCURRENCY, prompts)
    wall = time.perf_counter() - start
    if task is not None:
        stop.set()
        await task
    return {**run, "videos": done, "videos_per_minute": 60 * done / wall if videos else 0.0}


def mixed_main(model_dir: Path, wan_dir: Path, vocab: int, rounds: int,
               rng: np.random.Generator) -> dict[str, Any]:
    server = Server("--model-dir", str(model_dir), "--model-dir", str(wan_dir),
                    "--max-queue", "1024")
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "with_videos": []}
    try:
        asyncio.run(lm_run(server.url, 2, rng.integers(2, vocab, (4, PROMPT_TOKENS)).tolist()))
        asyncio.run(mixed_run(server.url, rng.integers(2, vocab, (8, PROMPT_TOKENS)).tolist(),
                              True))  # warm-up: the video graphs compiled at this size
        for r in range(rounds):
            prompts = rng.integers(2, vocab, (MIXED_REQUESTS, PROMPT_TOKENS)).tolist()
            order = ["alone", "with_videos"] if r % 2 == 0 else ["with_videos", "alone"]
            for name in order:
                run = asyncio.run(mixed_run(server.url, prompts, name == "with_videos"))
                runs[name].append(run)
                log(f"mixed round {r} {name}: TTFT p99 {1000 * run['ttft_p99_s']:.0f} ms, "
                    f"{run['tokens_per_s']:.0f} tok/s, {run['videos_per_minute']:.1f} "
                    "videos/min")
    finally:
        server.stop()
    out = {name: summarize(values) for name, values in runs.items()}
    out["concurrency"], out["requests"], out["video"] = (MIXED_CONCURRENCY, MIXED_REQUESTS,
                                                         MIXED_VIDEO)
    out["ttft_p99_with_videos_over_alone"] = (out["with_videos"]["ttft_p99_s"]["median"]
                                              / out["alone"]["ttft_p99_s"]["median"])
    return out


async def chat_run(url: str, system: list[int], users: list[list[list[int]]]
                   ) -> dict[str, Any]:
    """One conversation per ``users[i]`` (its turns' new tokens), all at once, each turn
    resending the system prompt and the history; the run's figures."""
    first_ttft, later_ttft, cached, tokens = [], [], [], 0

    async def conversation(turns: list[list[int]], http: httpx.AsyncClient) -> None:
        nonlocal tokens
        history: list[int] = []
        for number, user in enumerate(turns):
            prompt = system + history + user
            body = {"prompt": prompt, "max_tokens": CHAT_NEW_TOKENS, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            sent, first, answer = time.perf_counter(), None, []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        details = chunk["usage"].get("prompt_tokens_details") or {}
                        cached.append(details.get("cached_tokens", 0) / len(prompt))
                    if not chunk.get("choices"):
                        continue
                    ids = chunk["choices"][0]["token_ids"]
                    if ids and first is None:
                        first = time.perf_counter()
                    answer += ids
            (first_ttft if number == 0 else later_ttft).append(first - sent)
            tokens += len(answer)
            history += user + answer

    limits = httpx.Limits(max_connections=len(users) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(conversation(turns, http) for turns in users))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens_per_s": tokens / wall,
            "first_turn_ttft_p50_s": percentile(first_ttft, 50),
            "later_turn_ttft_p50_s": percentile(later_ttft, 50),
            "later_turn_ttft_p99_s": percentile(later_ttft, 99),
            "cached_prompt_share_p50": percentile(cached, 50) if cached else 0.0}


def chat_main(rounds: int) -> None:
    """The chat workload, prefix cache on against off (module docstring)."""
    model_dir, vocab = export_lm("bench")
    rng = np.random.default_rng(SEED)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "cores": os.cpu_count(), "load_start": load_average(), "model": "bench",
        "system_tokens": CHAT_SYSTEM_TOKENS, "turns": CHAT_TURNS,
        "user_tokens": CHAT_USER_TOKENS, "new_tokens": CHAT_NEW_TOKENS,
        "conversations": CHAT_CONVERSATIONS, "rounds": rounds,
        "command": " ".join(["python", "benchmarks/service_load.py", *sys.argv[1:]])}
    common = ("--model-dir", str(model_dir), "--max-queue", "1024", "--cache-tokens",
              str(CHAT_CACHE_TOKENS))
    servers = {"prefix_cache": Server(*common), "no_prefix_cache": Server(*common,
                                                                          "--no-prefix-cache")}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    try:
        for server in servers.values():  # warm-up: first compiles, first pages
            asyncio.run(lm_run(server.url, 2, rng.integers(2, vocab, (2, PROMPT_TOKENS))
                               .tolist()))
        for r in range(rounds):
            # a new system prompt per round: the cached server starts each round cold
            system = rng.integers(2, vocab, CHAT_SYSTEM_TOKENS).tolist()
            users = rng.integers(2, vocab, (CHAT_CONVERSATIONS, CHAT_TURNS,
                                            CHAT_USER_TOKENS)).tolist()
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                run = asyncio.run(chat_run(servers[name].url, system, users))
                runs[name].append(run)
                log(f"chat round {r} {name}: {run['tokens_per_s']:.1f} tok/s, TTFT first "
                    f"{run['first_turn_ttft_p50_s']:.2f} s later "
                    f"{run['later_turn_ttft_p50_s']:.2f} s, cached share "
                    f"{run['cached_prompt_share_p50']:.2f}")
    finally:
        for server in servers.values():
            server.stop()
    result["chat"] = {name: summarize(runs[name]) for name in servers}
    on, off = result["chat"]["prefix_cache"], result["chat"]["no_prefix_cache"]
    result["ratios"] = {
        "later_over_first_turn_ttft_prefix_cache":
            on["later_turn_ttft_p50_s"]["median"] / on["first_turn_ttft_p50_s"]["median"],
        "later_over_first_turn_ttft_no_prefix_cache":
            off["later_turn_ttft_p50_s"]["median"] / off["first_turn_ttft_p50_s"]["median"],
        "tokens_per_s_prefix_cache_over_none":
            on["tokens_per_s"]["median"] / off["tokens_per_s"]["median"],
    }
    result["load_end"] = load_average()
    CHAT_OUT.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["ratios"], indent=2))
    for name in servers:
        s = result["chat"][name]
        print(f"{name:16s}: {s['tokens_per_s']['median']:6.1f} tok/s (range "
              f"{s['tokens_per_s']['min']:.1f}-{s['tokens_per_s']['max']:.1f}), TTFT first "
              f"turn {s['first_turn_ttft_p50_s']['median']:.2f} s, later turns p50 "
              f"{s['later_turn_ttft_p50_s']['median']:.2f} s p99 "
              f"{s['later_turn_ttft_p99_s']['median']:.2f} s, cached prompt share "
              f"{s['cached_prompt_share_p50']['median']:.2f}")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-video", action="store_true")
    parser.add_argument("--chat", action="store_true",
                        help="the chat workload: prefix cache on against off")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if args.chat:
        chat_main(args.rounds)
        return
    model_dir, vocab = export_lm(args.model)
    wan_dir = None if args.no_video else export_wan()
    rng = np.random.default_rng(SEED)
    result: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                              "load_start": load_average(), "model": args.model,
                              "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
                              "rounds": args.rounds, "lm": {}, "video": None}
    servers = {"batching": Server("--model-dir", str(model_dir), "--max-queue", "1024"),
               "one-at-a-time": Server("--model-dir", str(model_dir), "--max-running", "1",
                                       "--max-queue", "1024")}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        name: {c: [] for c in CONCURRENCY} for name in servers}
    try:
        for server in servers.values():  # warm-up: first compiles, first pages
            asyncio.run(lm_run(server.url, 2, rng.integers(2, vocab, (4, PROMPT_TOKENS))
                               .tolist()))
        for r in range(args.rounds):
            for c in CONCURRENCY:
                prompts = rng.integers(2, vocab, (REQUESTS[c], PROMPT_TOKENS)).tolist()
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:  # the same prompts on both, alternating which goes first
                    run = asyncio.run(lm_run(servers[name].url, c, prompts))
                    runs[name][c].append(run)
                    log(f"round {r} c={c} {name}: {run['tokens_per_s']:.0f} tok/s, TTFT p99 "
                        f"{1000 * run['ttft_p99_s']:.0f} ms")
    finally:
        for server in servers.values():
            server.stop()
    for name in servers:
        result["lm"][name] = {str(c): summarize(runs[name][c]) for c in CONCURRENCY}
    batching, single = result["lm"]["batching"], result["lm"]["one-at-a-time"]
    result["ratios"] = {
        "tokens_per_s_c16_batching_over_one_at_a_time":
            batching["16"]["tokens_per_s"]["median"] / single["16"]["tokens_per_s"]["median"],
        "ttft_p99_c16_over_c1_batching":
            batching["16"]["ttft_p99_s"]["median"] / batching["1"]["ttft_p99_s"]["median"],
    }
    if wan_dir is not None:
        server = Server("--model-dir", str(wan_dir))
        try:
            asyncio.run(video_run(server.url, 1, 1))  # warm-up
            result["video"] = summarize([asyncio.run(video_run(server.url, VIDEOS, 2))
                                         for _ in range(args.rounds)])
            result["video"]["frames"], result["video"]["size"] = VIDEO_FRAMES, VIDEO_SIZE
            result["video"]["steps"] = VIDEO_STEPS
        finally:
            server.stop()
        result["mixed"] = mixed_main(model_dir, wan_dir, vocab, args.rounds, rng)
        result["ratios"]["ttft_p99_with_videos_over_alone"] = \
            result["mixed"]["ttft_p99_with_videos_over_alone"]
    result["load_end"] = load_average()
    OUT.write_text(json.dumps(result, indent=2))
    print(json.dumps({"ratios": result["ratios"], "video": result["video"]}, indent=2))
    for name in servers:
        for c in CONCURRENCY:
            s = result["lm"][name][str(c)]
            print(f"{name:14s} c={c:2d}: {s['requests_per_s']['median']:6.2f} req/s "
                  f"{s['tokens_per_s']['median']:7.1f} tok/s (range "
                  f"{s['tokens_per_s']['min']:.1f}-{s['tokens_per_s']['max']:.1f}), TTFT p50 "
                  f"{1000 * s['ttft_p50_s']['median']:.0f} p99 "
                  f"{1000 * s['ttft_p99_s']['median']:.0f} ms, latency p50 "
                  f"{1000 * s['latency_p50_s']['median']:.0f} p99 "
                  f"{1000 * s['latency_p99_s']['median']:.0f} ms")


if __name__ == "__main__":
    main()
