"""The `numaov` command line: a thin shell over the library.

Each subcommand is a `cmd_*` function taking the parsed arguments and
returning an exit code; formatting functions in the library return strings
and only this module prints. `main()` is the one place that catches
`NumaovError`, prints it as one line and exits non-zero; when the error names
the library parameter it is about (`NumaovError.parameter`), the line starts
with the running command's flag for it (`--prompt-ids: ...`). Choices come
from the library's tuples (`LOWERINGS`, `PRECISIONS`, `TIMESTEP_KINDS`, each pipeline's
`BACKENDS`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from numaov import NumaovError, __version__
from numaov.console import ProgressLine, quiet_libraries
from numaov.manifest import LOWERINGS, PRECISIONS, TIMESTEP_KINDS, WEIGHT_FORMATS
from numaov.runtime.lm import engine as lm_engine
from numaov.runtime.wan import denoisers as wan_denoisers
from numaov.runtime.wan import parallel as wan_parallel
from numaov.runtime.wan import schedules as wan_schedules


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines go to stderr, so stdout stays clean for results."""
    if getattr(args, "quiet", False):
        return None
    return lambda message: print(f"numaov: {message}", file=sys.stderr, flush=True)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    # main() names the flag of a library error's parameter from this parser's options.
    parser.set_defaults(command_parser=parser)


def _add_force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --out that is not a numaov export")


def _add_lm_backend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=lm_engine.BACKENDS, default="openvino",
                        help="what runs each rank's step (default openvino)")


def _backend_list(text: str) -> list[str]:
    """``--backends a,b``: the names, checked by the library against its BACKENDS."""
    return text.split(",")


# -- doctor -------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from numaov.runtime.doctor import collect_report, format_report

    report = collect_report(model_dir=args.model_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="report topology, ISA, binding plan, OpenVINO and /dev/shm")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="an export: also report, for a language model, each rank's expert "
                        "store (its bytes, and the NUMA nodes its pages are on) after checking "
                        "its digests; for Wan, each graph's IR weights and about what it holds "
                        "once compiled")
    p.set_defaults(func=cmd_doctor)


# -- demo ---------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's first command: the built-in models, exported, run and compared."""
    from numaov import demo

    print("\n".join(demo.machine_lines()), flush=True)
    rows = []
    with ProgressLine(None if args.quiet else sys.stderr) as line:
        for section in demo.run_sections(Path(args.out), line):
            print("\n".join(section.lines), flush=True)
            rows += section.rows
    print("\n".join(demo.speed_table(rows)))
    if (note := demo.slow_note(rows)) is not None:
        print(note)
    return 0


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="export and run the small embedded models, print parity and speed")
    p.add_argument("--out", default="out/demo", help="where exported models go (default out/demo)")
    _add_common(p)
    p.set_defaults(func=cmd_demo)


# -- export wan / run wan ---------------------------------------------------------------


def cmd_export_wan(args: argparse.Namespace) -> int:
    from numaov.exporter.wan_export import export_wan

    manifest = export_wan(args.checkpoint, args.out, args.precision, args.ops, _progress(args),
                          timestep=args.timestep, force=args.force, loras=args.loras or (),
                          loras_2=args.loras_2 or (), reuse=args.reuse,
                          sequence_parallel=args.sequence_parallel or ())
    print(manifest.summary(args.out))
    return 0


def _add_export_wan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wan", help="export a diffusers Wan pipeline or transformer directory")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="diffusers Wan pipeline directory (model_index.json), or a "
                   "WanTransformer3DModel directory (config.json + safetensors)")
    p.add_argument("--out", required=True, metavar="DIR", help="where ONNX, IR and manifest go")
    p.add_argument("--precision", choices=PRECISIONS, default="f32",
                   help="IR weights and inference precision (default f32)")
    p.add_argument("--ops", choices=LOWERINGS, default="decomposed",
                   help="ONNX lowering of the fallback ops (default decomposed)")
    p.add_argument("--timestep", choices=TIMESTEP_KINDS, default="scalar",
                   help="timestep input: [batch] (default), or per-frame [batch, latent frames] "
                   "for Wan 2.2 TI2V image-to-video")
    p.add_argument("--lora", dest="loras", action="append", type=_lora_spec,
                   metavar="FILE[:SCALE]",
                   help="merge a LoRA (.safetensors: diffusers/PEFT, original Wan, lightx2v or "
                   "musubi-tuner keys) into the transformer's weights before export, as "
                   "diffusers' fuse_lora(lora_scale=SCALE) (default 1); repeat to stack")
    p.add_argument("--lora-2", dest="loras_2", action="append", type=_lora_spec,
                   metavar="FILE[:SCALE]",
                   help="the same for a Wan 2.2 A14B pipeline's second expert (transformer_2)")
    p.add_argument("--reuse", metavar="DIR",
                   help="an earlier `numaov export wan` output: its graphs exported from the "
                   "same checkpoint files with the same options and versions are taken as "
                   "they are (hard links) instead of exported again, e.g. UMT5 and the VAE "
                   "when only a LoRA changed")
    p.add_argument("--sequence-parallel", type=_rank_counts, metavar="N[,N...]",
                   help="also export each transformer split over N sequence-parallel ranks, "
                   "for `run wan --parallel sequence|both` (N dividing the attention heads; "
                   "one graph per N, in sequence_<N>/)")
    _add_force(p)
    _add_common(p)
    p.set_defaults(func=cmd_export_wan)


def _rank_counts(text: str) -> list[int]:
    """``--sequence-parallel 2,4``: rank counts of at least 2."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}; expected rank counts of at least 2, comma-separated (e.g. 2 or 2,4)")
    return counts


def _lora_spec(text: str):
    """``--lora FILE[:SCALE]``: parsed by the library (numaov.models.wan.lora.LoraSpec)."""
    from numaov.models.wan.lora import LoraSpec

    try:
        return LoraSpec.parse(text)
    except NumaovError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_run_wan(args: argparse.Namespace) -> int:
    from numaov.runtime.wan.request import WanSampleRequest
    from numaov.runtime.wan.sampler import run_wan

    if (args.prompt is None) == (args.text_embeddings is None):
        raise NumaovError("expected exactly one of --prompt (text to video with a pipeline "
                          "export) and --text-embeddings (latents from your own embeddings)")
    # Flags of the other mode would be ignored: refuse them instead.
    other = ({"--negative-embeddings": args.negative_embeddings,
              "--first-frame-latents": args.first_frame_latents} if args.prompt is not None
             else {"--negative-prompt": args.negative_prompt, "--fps": args.fps,
                   "--vae-tiling": args.vae_tiling or None, "--image": args.image})
    given = [flag for flag, value in other.items() if value is not None]
    if given:
        mode = "--prompt" if args.prompt is not None else "--text-embeddings"
        raise NumaovError(f"{', '.join(given)}: not used with {mode}; expected only the "
                          "flags of one mode (see `numaov run wan --help`)")
    request = WanSampleRequest(frames=args.frames, height=args.height, width=args.width,
                               steps=args.steps, guidance=args.guidance, seed=args.seed,
                               guidance_2=args.guidance_2, shift=args.shift,
                               sampler=args.sampler, cache=args.cache)
    if args.prompt is not None:
        from numaov.runtime.wan.pipeline import run_wan_pipeline
        from numaov.runtime.wan.vae import VaeTiling
        from numaov.runtime.wan.video_output import DEFAULT_FPS

        video = run_wan_pipeline(args.model_dir, request, args.prompt, args.out,
                                 negative_prompt=args.negative_prompt or "",
                                 backend=args.backend,
                                 workers=args.workers, parallel=args.parallel,
                                 fps=DEFAULT_FPS if args.fps is None else args.fps,
                                 vae_tiling=VaeTiling() if args.vae_tiling else None,
                                 image=args.image, progress=_progress(args))
        print(video.summary(args.out))
        return 0
    result = run_wan(args.model_dir, request, args.text_embeddings, args.out,
                     negative_embeddings=args.negative_embeddings,
                     first_frame_latents=args.first_frame_latents, backend=args.backend,
                     workers=args.workers, parallel=args.parallel, progress=_progress(args))
    print(result.summary(args.out))
    return 0


def _add_run_wan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wan", help="text to video (pipeline export) or latents with a Wan model")
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="output of `numaov export wan`")
    p.add_argument("--prompt", metavar="TEXT",
                   help="text to video: needs an export of a diffusers pipeline directory")
    p.add_argument("--negative-prompt", metavar="TEXT",
                   help="with --prompt: the unconditional branch's prompt (default empty)")
    p.add_argument("--fps", type=int, help="with --prompt: frame rate of a video --out "
                   "(default 16)")
    p.add_argument("--vae-tiling", action="store_true",
                   help="with --prompt: decode in overlapping tiles as diffusers' "
                   "vae.enable_tiling() (256-pixel tiles every 192); with --workers 2 the "
                   "tiles are spread over both workers")
    p.add_argument("--image", metavar="FILE",
                   help="with --prompt: image-to-video, the first frame (PNG/JPEG/WebP of "
                   "--width x --height); needs a Wan 2.2 TI2V or I2V pipeline export, and an "
                   "I2V export (WanImageToVideoPipeline) needs it")
    p.add_argument("--frames", type=int, required=True, help="video frames, 4k+1 (e.g. 81)")
    p.add_argument("--height", type=int, required=True,
                   help="video height in pixels, multiple of 16")
    p.add_argument("--width", type=int, required=True, help="video width in pixels, multiple of 16")
    p.add_argument("--steps", type=int, required=True, help="denoising steps")
    p.add_argument("--guidance", type=float, required=True,
                   help="classifier-free guidance scale; 1 runs one branch per step (no "
                   "unconditional pass: distilled LoRAs)")
    p.add_argument("--seed", type=int, required=True, help="seed of the initial noise")
    p.add_argument("--guidance-2", type=float, metavar="G2",
                   help="Wan 2.2 two experts: guidance of the low-noise expert (default "
                   "--guidance)")
    p.add_argument("--text-embeddings", metavar="FILE.npy",
                   help="instead of --prompt: text encoder output, [S, D] or [1, S, D]")
    p.add_argument("--negative-embeddings", metavar="FILE.npy",
                   help="unconditional embeddings, same shape (default zeros)")
    p.add_argument("--first-frame-latents", metavar="FILE.npy",
                   help="image-to-video: normalised VAE latents of the first frame, [C, 1, H/8, "
                   "W/8] or [1, C, 1, H/8, W/8]; needs an export with --timestep per-frame")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="with --prompt: .mp4, .webp, .gif, a directory (PNG frames) or .npy "
                   "(latents); with --text-embeddings: .npy, the final latents [1, C, F, H, W]")
    p.add_argument("--backend", choices=wan_denoisers.BACKENDS, default="openvino",
                   help="what runs the models (default openvino)")
    p.add_argument("--workers", type=int, default=1,
                   help="pinned worker processes for one video, one per NUMA node (default 1); "
                   "--parallel says how they share it")
    p.add_argument("--parallel", choices=wan_parallel.SPLITS,
                   help="guidance: 2 workers, one guidance branch each; sequence: the video's "
                   "tokens in N shares (needs an export with --sequence-parallel N); both: 2 "
                   "branches x N/2 token shares (default: guidance for 2 workers with "
                   "guidance on, else sequence)")
    p.add_argument("--scheduler", dest="sampler", choices=wan_schedules.SAMPLERS,
                   help="the sampler: unipc (UniPCMultistepScheduler with flow sigmas) or euler "
                   "(FlowMatchEulerDiscreteScheduler); default: with --prompt the pipeline's "
                   "own scheduler, with --text-embeddings euler")
    p.add_argument("--shift", type=float,
                   help="timestep shift (flow_shift): default with --prompt the pipeline's "
                   "scheduler config's, with --text-embeddings 5.0 (Wan 2.1 T2V; 3.0 for "
                   "480p; distilled LoRAs: 5.0)")
    p.add_argument("--cache", metavar="first-block[:T]|magcache[:T[:K[:R]]]|magcache:calibrate",
                   help="step caching as diffusers' enable_cache: first-block (FirstBlockCache: "
                   "a branch whose first block's residual changed by at most T, default 0.05, "
                   "since its last full evaluation skips the other blocks) or magcache "
                   "(MagCache: steps skipped while the accumulated error of the transformer's "
                   "magnitude ratios is at most T, default 0.06, at most K in a row, default "
                   "3, none in the first R of the steps, default 0.2; magcache:calibrate "
                   "measures the ratios once into the export); openvino backend")
    _add_common(p)
    p.set_defaults(func=cmd_run_wan)


# -- export lm / run lm (aliases: export deepseek / run deepseek) -------------------------


def cmd_export_lm(args: argparse.Namespace) -> int:
    from numaov.exporter.lm_export import export_lm

    manifest = export_lm(args.checkpoint, args.out, args.dp, args.precision,
                         _progress(args), force=args.force, weights=args.weights,
                         fp8_dense=args.fp8_dense)
    print(manifest.summary(args.out))
    for note in manifest.notes:
        print(f"note: {note}")
    return 0


def _add_export_lm_parser(sub: argparse._SubParsersAction) -> None:
    from numaov.models.families import FAMILIES

    # "deepseek" is the command's name from before the model families: kept for one release
    p = sub.add_parser("lm", aliases=["deepseek"],
                       help="export a Hugging Face MoE language model per DP rank (alias: deepseek)")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="Hugging Face model directory (config.json + model.safetensors or sharded "
                   f"index); its model_type picks the family ({', '.join(FAMILIES)})")
    p.add_argument("--dp", type=int, default=1, metavar="N",
                   help="data-parallel ranks, one graph each (default 1); must divide the MLP "
                   "and expert intermediate sizes")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where rank_<r>/ graphs and manifest.json go")
    p.add_argument("--precision", choices=PRECISIONS, default="f32",
                   help="IR weights and inference precision (default f32)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="weight format of the IR (default: the --precision): bf16 stores every "
                   "expert and weight bf16; int8 / int4 are weight-only, the routed experts in "
                   "numaov's MoE op and the other layers through NNCF")
    p.add_argument("--fp8-dense", action="store_true",
                   help="with --weights fp8 of a released FP8 checkpoint: also keep its "
                   "attention and MLP projections fp8, run by numaov's DenseLinear op (faster "
                   "decode of a few rows per rank, slower from about 5 rows without AMX)")
    _add_force(p)
    _add_common(p)
    p.set_defaults(func=cmd_export_lm)


def cmd_run_lm(args: argparse.Namespace) -> int:
    from numaov.runtime.lm.engine import (
        GenerationInputError,
        SamplingParams,
        encode_prompts,
        format_generation,
        load_tokenizer,
        open_lm_manifest,
        parse_prompt_ids,
        run_lm,
    )

    if (args.prompt_ids is None) == (not args.prompt):
        raise GenerationInputError(
            "give the prompts once: --prompt-ids '1,2,3;4,5' or --tokenizer DIR with one "
            "--prompt TEXT per prompt"
        )
    # Token-id prompts print ids unless --tokenizer is given; text prompts fall back on the
    # export's own tokenizer.
    tokenizer_dir = (_tokenizer_dir(args.tokenizer, args.model_dir) if args.prompt
                     else args.tokenizer)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if args.prompt:
        if tokenizer is None:
            # A missing or foreign model directory is named as such, not as a missing tokenizer.
            open_lm_manifest(args.model_dir, args.backend)
            raise GenerationInputError(
                f"--prompt TEXT needs a tokenizer: {args.model_dir!r} has no tokenizer.json "
                "(its checkpoint had none); expected --tokenizer DIR (a tokenizer.json)")
        prompts = encode_prompts(tokenizer, args.prompt)
    else:
        prompts = parse_prompt_ids(args.prompt_ids)
    params = SamplingParams(
        args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop_token_ids=tuple(args.stop_token_ids), stop=tuple(args.stop),
        logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    result = run_lm(args.model_dir, prompts, args.max_new_tokens, args.backend,
                          params=params, cache_tokens=args.cache_tokens,
                          prefill_chunk=args.prefill_chunk, tokenizer=tokenizer,
                          progress=_progress(args), prefix_cache=args.prefix_cache)
    print(format_generation(result, prompts, tokenizer))
    return 0


def _tokenizer_dir(given: str | None, model_dir: str | Path) -> str | Path | None:
    """``--tokenizer DIR`` when given, else the model directory when it carries a
    ``tokenizer.json`` (an LM export copies its checkpoint's), else None."""
    if given is not None:
        return given
    return model_dir if (Path(model_dir) / "tokenizer.json").is_file() else None


def _token_id_list(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of token ids; expected "
                                         "comma-separated non-negative integers: '1,2'")
    return [int(t) for t in items]


def _add_lm_engine_options(p: argparse.ArgumentParser) -> None:
    from numaov.runtime.lm.cache import DEFAULT_CACHE_TOKENS
    from numaov.runtime.lm.scheduler import DEFAULT_PREFILL_CHUNK

    p.add_argument("--cache-tokens", type=int, default=None, metavar="N",
                   help="KV cache capacity per rank, in tokens (default "
                   f"{DEFAULT_CACHE_TOKENS}; checked against the node's free memory)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="prompt tokens per rank per step; longer prompts are read over several "
                   f"steps while the others decode (default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep fed tokens' KV entries for later prompts that start with the "
                   "same tokens (default: on)")


def _add_run_lm_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lm", aliases=["deepseek"],
                       help="generation with an exported language model (greedy or sampled, "
                       "continuous batching), one worker per DP rank (alias: deepseek)")
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="output of `numaov export lm`")
    p.add_argument("--prompt-ids", metavar="IDS",
                   help="token ids, ',' between ids and ';' between prompts: '1,2,3;4,5'")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="directory with a Hugging Face tokenizer.json: prompts and output as text")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt as text (needs --tokenizer; repeat for several prompts)")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N",
                   help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); above 0, sample from the logits divided by it")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches P")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens "
                   "(0 = all)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of each prompt's sampler (the same seed, the same tokens)")
    p.add_argument("--stop-token-ids", type=_token_id_list, default=[], metavar="IDS",
                   help="token ids that end a prompt's generation: '1,2'")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="text that ends a prompt's generation (needs --tokenizer; repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's end-of-sequence token")
    p.add_argument("--logprobs", action="store_true",
                   help="print the log-probability of every generated token")
    _add_lm_engine_options(p)
    _add_lm_backend(p)
    _add_common(p)
    p.set_defaults(func=cmd_run_lm)


# -- serve ------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    import contextlib
    import os
    import signal

    from numaov.runtime.lm.cache import DEFAULT_CACHE_TOKENS
    from numaov.runtime.lm.engine import load_tokenizer
    from numaov.runtime.service.app import build_app, served_routes
    from numaov.runtime.service.chat_output import check_parser_tags
    from numaov.runtime.service.chat_template import load_chat_template
    from numaov.runtime.service.http_common import API_KEY_ENV, ServiceOptions
    from numaov.runtime.service.lm_requests import ChatOptions, Limits
    from numaov.runtime.service.lm_service import LMService
    from numaov.runtime.service.server import listen, serve_forever
    from numaov.runtime.service.video_service import ResultLimits, VideoService

    def say(message: str) -> None:
        print(f"numaov serve: {message}", flush=True)

    chat = ChatOptions(template_kwargs=args.chat_template_kwargs or {},
                       reasoning_parser=args.reasoning_parser,
                       tool_call_parser=args.tool_call_parser)
    served_models = _served_models(args.model_dir, args.model_name or [])
    lm_dir, name = served_models.get("lm", (None, ""))
    video_dir, video_name = served_models.get("video", (None, ""))
    _refuse_flags_without(lm_dir, "a language model's chat answers",
                          "a `numaov export lm` directory",
                          ("--chat-template-kwargs", args.chat_template_kwargs),
                          ("--reasoning-parser", args.reasoning_parser),
                          ("--tool-call-parser", args.tool_call_parser))
    _refuse_flags_without(video_dir, "the Wan pipeline's jobs", "a Wan pipeline export",
                          ("--sync-videos", args.sync_videos or None),
                          ("--video-memory", args.video_memory))
    tokenizer = template = None
    if lm_dir is not None:
        tokenizer_dir = _tokenizer_dir(args.tokenizer, lm_dir)
        tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        template = load_chat_template([tokenizer_dir, lm_dir])
        for param in ("reasoning_parser", "tool_call_parser"):
            if getattr(chat, param) is not None:
                check_parser_tags(tokenizer, getattr(chat, param), param)
        chat = _family_tool_call_parser(chat, lm_dir, tokenizer, say)
    options = ServiceOptions(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        limits=Limits(max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens),
        chat=chat, sync_videos=args.sync_videos)
    cache_tokens = DEFAULT_CACHE_TOKENS if args.cache_tokens is None else args.cache_tokens
    # While the models load, SIGTERM unwinds like Ctrl-C: the workers started so far stop.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.ExitStack() as stack:
        try:
            sock = stack.enter_context(listen(args.host, args.port))
            video = None
            if video_dir is not None:
                video = stack.enter_context(VideoService(
                    video_dir, video_name, args.backend, results=ResultLimits(
                        args.video_results, args.video_results_size, args.video_results_ttl),
                    memory_budget=args.video_memory))
            service = None
            if lm_dir is not None:
                service = stack.enter_context(LMService(
                    lm_dir, args.backend, cache_tokens=cache_tokens,
                    prefill_chunk=args.prefill_chunk, max_running=args.max_running,
                    tokenizer=tokenizer, progress=_progress(args),
                    prefix_cache=args.prefix_cache))
            if video is not None:  # after the LM: the memory budget is what the LM leaves
                video.start()
        finally:
            signal.signal(signal.SIGTERM, previous)
        host, port = sock.getsockname()[:2]
        app = build_app(service, name, tokenizer, template=template, options=options,
                        video=video)
        key = "; API key required" if options.api_key else ""
        served = []
        if service is not None:
            parsers = "".join(f"; {what} parser {value}" for what, value in (
                ("reasoning", chat.reasoning_parser), ("tool-call", chat.tool_call_parser))
                if value is not None)
            served.append(f"{name!r} ({service.world_size} rank(s), {args.backend}, KV cache "
                          f"{cache_tokens} tokens per rank; chat template: {template.origin}"
                          f"{parsers})")
        if video is not None:
            budget = (f"{video.memory_budget / (1 << 30):.1f} GiB"
                      if video.memory_budget is not None else "unbounded")
            served.append(f"{video.model_name!r} (Wan pipeline, {args.backend}, in its own "
                          f"unpinned process; memory budget {budget}"
                          f"{'; synchronous videos' if args.sync_videos else ''})")
        routes = map(str, served_routes(service is not None, video is not None))
        say(f"{' and '.join(served)}{key} on http://{host}:{port}  ({', '.join(routes)})")
        serve_forever(app, sock, say, on_stop=video.stop if video is not None else None,
                      timeout_s=args.shutdown_timeout)
        say("stopped")
    return 0


def _served_models(dirs: list[str], names: list[str]) -> dict[str, tuple[str, str]]:
    """{"lm": (directory, model id), "video": ...} among ``--model-dir``: at most one of each.
    ``names`` are the ``--model-name`` values, matched to the directories in order; the others
    are named by their directory, with as many parent directories as make every id unique
    (``deepseek/model`` and ``wan/model``)."""
    from numaov.manifest import LM_KIND, PIPELINE_KIND
    from numaov.runtime.manifest_reader import read_manifest

    if len(names) > len(dirs):
        raise NumaovError(f"{len(names)} --model-name values for {len(dirs)} --model-dir; "
                          "expected at most one name per model directory, in the same order",
                          parameter="model_name")
    if not all(names):
        raise NumaovError("--model-name is empty; expected a model id such as 'chat'",
                          parameter="model_name")
    given = list(names)
    if len(set(given)) < len(given):
        raise NumaovError(f"--model-name values {', '.join(map(repr, names))} repeat a name; "
                          "expected a different id for each served model",
                          parameter="model_name")
    found: dict[str, str] = {}
    for directory in dirs:
        kind = read_manifest(directory).kind
        role = {LM_KIND: "lm", PIPELINE_KIND: "video"}.get(kind)
        if role is None:
            raise NumaovError(f"{directory!r} holds a {kind!r} export; expected a `numaov export "
                              "lm` directory or a Wan pipeline export (`numaov export "
                              "wan` of a diffusers pipeline directory)", parameter="model_dir")
        if role in found:
            raise NumaovError(f"{found[role]!r} and {directory!r} are both {kind!r} exports; "
                              "expected at most one language model and one Wan pipeline",
                              parameter="model_dir")
        found[role] = directory
    ids = [names[i] if i < len(names) else "" for i in range(len(dirs))]
    paths = [Path(d).resolve().parts for d in dirs]
    depth = [1] * len(dirs)
    while True:
        for i, parts in enumerate(paths):
            if not names[i:i + 1]:
                ids[i] = "/".join(parts[-depth[i]:]) or "model"
        clashes = [i for i in range(len(dirs)) if ids.count(ids[i]) > 1
                   and not names[i:i + 1] and depth[i] < len(paths[i])]
        if not clashes:
            break
        for i in clashes:
            depth[i] += 1
    if len(set(ids)) < len(ids):
        raise NumaovError(f"the served models would share the id {ids[0]!r}; expected "
                          "--model-name giving each its own", parameter="model_name")
    role_of = {directory: role for role, directory in found.items()}
    return {role_of[d]: (d, ids[i]) for i, d in enumerate(dirs)}


def _size(text: str) -> int:
    """A size in bytes: a number, or one with K, M, G or T (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text.rstrip("KMGTkmgtiB"), text[len(text.rstrip("KMGTkmgtiB")):]
    unit = unit.upper().removesuffix("IB").removesuffix("B")
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; expected bytes, or a number "
                                         "with K, M, G or T (e.g. 8G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return int(value)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _refuse_flags_without(served: str | None, shaping: str, expected: str,
                          *flags: tuple[str, Any]) -> None:
    """One line naming the ``flags`` given (value not None) that shape what is not served."""
    given = [flag for flag, value in flags if value is not None]
    if served is None and given:
        raise NumaovError(f"{', '.join(given)} shape {shaping}, and none is served; expected "
                          f"{expected} among --model-dir", parameter="model_dir")


def _family_tool_call_parser(chat: Any, lm_dir: str, tokenizer: Any,
                             say: Callable[[str], None]) -> Any:
    """``chat`` with the served family's tool-call parser when ``--tool-call-parser`` was
    not given (``LMFamily.tool_call_parser``: DeepSeek-V3's markers, Qwen's hermes JSON); left
    off, with a line saying why, when the tokenizer does not write the parser's tags back."""
    from dataclasses import replace

    from numaov.models.families import family_named
    from numaov.runtime.manifest_reader import read_manifest
    from numaov.runtime.service.chat_output import check_parser_tags

    if chat.tool_call_parser is not None:
        return chat
    parser = family_named(str(read_manifest(lm_dir).record.family)).tool_call_parser
    if parser is None:
        return chat
    try:
        check_parser_tags(tokenizer, parser, "tool_call_parser")
    except NumaovError as exc:
        say(f"tool calls not read: the family's parser {parser} cannot be used ({exc})")
        return chat
    return replace(chat, tool_call_parser=parser)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; expected 0 to 65535")
    return int(text)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an exported language model over HTTP "
                       "(OpenAI-style /v1/completions), one worker per DP rank")
    from numaov.runtime.lm.scheduler import DEFAULT_MAX_RUNNING
    from numaov.runtime.service.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS
    from numaov.runtime.service.http_common import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
    from numaov.runtime.service.server import SHUTDOWN_TIMEOUT_S
    from numaov.runtime.service.video_service import (
        KEPT_RESULT_BYTES,
        KEPT_RESULTS,
        RESULT_TTL_S,
    )

    p.add_argument("--model-dir", required=True, action="append", metavar="DIR",
                   help="output of `numaov export lm` or a Wan pipeline export; repeat "
                   "to serve one of each")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health and "
                   "/metrics (default: $NUMAOV_API_KEY; none: open)")
    p.add_argument("--max-queue", type=_positive, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="requests waiting for a place beyond which a new one gets 429 "
                   f"(default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-running", type=_positive, default=DEFAULT_MAX_RUNNING, metavar="N",
                   help="sequences in the batch per rank at once (default "
                   f"{DEFAULT_MAX_RUNNING}; 1: one request at a time)")
    p.add_argument("--max-body-bytes", type=_positive, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="N", help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES}; "
                   "larger: 413)")
    p.add_argument("--max-tokens", type=_positive, default=None, metavar="N",
                   help="most new tokens one request may ask for (default: the model's "
                   "positions)")
    p.add_argument("--max-prompt-tokens", type=_positive, default=None, metavar="N",
                   help="longest prompt in tokens (default: the model's positions)")
    p.add_argument("--port", type=_port, default=8000,
                   help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="directory with a Hugging Face tokenizer.json: text prompts and text "
                   "in the answers")
    p.add_argument("--model-name", metavar="NAME", action="append",
                   help="the model id clients send and /v1/models lists, one per --model-dir "
                   "in the same order (default: the directory's name, with parent "
                   "directories while two would be the same)")
    p.add_argument("--sync-videos", action="store_true",
                   help="POST /v1/videos answers once the videos are made (with n and "
                   "response_format) instead of at once with a job to poll")
    p.add_argument("--video-memory", type=_size, default=None, metavar="SIZE",
                   help="memory budget for video work, e.g. 16G: a job whose estimate is "
                   "larger is refused (default: MemAvailable once the models are loaded)")
    p.add_argument("--video-results", type=_positive, default=KEPT_RESULTS, metavar="N",
                   help=f"finished videos and URL images kept (default {KEPT_RESULTS}; the "
                   "oldest is dropped first)")
    p.add_argument("--video-results-size", type=_size, default=KEPT_RESULT_BYTES,
                   metavar="SIZE", help="bytes of finished files kept (default "
                   f"{KEPT_RESULT_BYTES >> 30}G; the oldest is dropped first)")
    p.add_argument("--video-results-ttl", type=_seconds, default=RESULT_TTL_S,
                   metavar="SECONDS", help="how long a finished video or URL image is kept "
                   f"(default {RESULT_TTL_S} s)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=SHUTDOWN_TIMEOUT_S,
                   metavar="SECONDS", help="the most a stop takes after the first SIGTERM or "
                   f"Ctrl-C (default {SHUTDOWN_TIMEOUT_S:g}; a second one stops at once)")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="extra chat template variables for every chat request, e.g. "
                   "'{\"enable_thinking\": false}' (a request's chat_template_kwargs "
                   "override them)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split chat answers at </think> into reasoning_content and content "
                   "(vLLM's parser names)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="read chat answers' tool calls into tool_calls, for requests with "
                   "tools (vLLM's parser names: hermes for Qwen, deepseek_v3)")
    _add_lm_engine_options(p)
    _add_lm_backend(p)
    _add_common(p)
    p.set_defaults(func=cmd_serve)


# -- bench ------------------------------------------------------------------------------------


def _check_json_target(path: str | None) -> None:
    """Refuse an unwritable --json path before the benchmark runs, not after."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir() or not target.parent.is_dir():
        raise NumaovError(f"--json {path!r} is a directory or its folder does not exist; "
                          "expected a file path in an existing directory")


def _finish_bench(report, args: argparse.Namespace) -> int:
    print(report.summary())
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_bench_wan(args: argparse.Namespace) -> int:
    from numaov.runtime.bench import bench_wan

    _check_json_target(args.json)
    return _finish_bench(bench_wan(
        args.model_dir, args.frames, args.height, args.width, args.backends,
        rounds=args.rounds, batch=args.batch, text_length=args.text_length,
        progress=_progress(args)), args)


def cmd_bench_lm(args: argparse.Namespace) -> int:
    from numaov.runtime.bench import bench_lm

    _check_json_target(args.json)
    return _finish_bench(bench_lm(
        args.model_dir, args.backends, batch=args.batch,
        prompt_length=args.prompt_length, max_new_tokens=args.max_new_tokens,
        rounds=args.rounds, progress=_progress(args)), args)


def _add_backends(parser: argparse.ArgumentParser, backends: Sequence[str]) -> None:
    parser.add_argument("--backends", type=_backend_list, default=["torch", "openvino"],
                        metavar="NAMES",
                        help=f"comma-separated from {', '.join(backends)}; the first is the "
                        "baseline of the ratios (default torch,openvino)")


def _add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="time the backends side by side on an exported model")
    bench_sub = bench.add_subparsers(dest="model", required=True, metavar="MODEL")
    p = bench_sub.add_parser("wan", help="one Wan transformer forward per backend and round")
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="output of `numaov export wan`")
    p.add_argument("--frames", type=int, required=True, help="video frames (4k+1)")
    p.add_argument("--height", type=int, required=True, help="pixels (multiple of 16)")
    p.add_argument("--width", type=int, required=True, help="pixels (multiple of 16)")
    p.add_argument("--batch", type=int, default=2,
                   help="samples per forward (default 2: a guidance pair)")
    p.add_argument("--text-length", type=int, default=64, metavar="N",
                   help="text embedding tokens (default 64)")
    _add_backends(p, wan_denoisers.BACKENDS)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, best kept (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    _add_common(p)
    p.set_defaults(func=cmd_bench_wan)
    p = bench_sub.add_parser("lm", aliases=["deepseek"],
                             help="greedy generation per backend on the rank workers (alias: "
                             "deepseek)")
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="output of `numaov export lm`")
    p.add_argument("--batch", type=int, default=4, help="prompts (default 4)")
    p.add_argument("--prompt-length", type=int, default=32, metavar="N",
                   help="tokens per prompt, seeded random ids (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=8, metavar="N",
                   help="tokens generated per prompt (default 8)")
    _add_backends(p, lm_engine.BACKENDS)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds, best kept (default 2)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    _add_common(p)
    p.set_defaults(func=cmd_bench_lm)


# -- parser and entry point ---------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with numaov's error shape: a bad argument, missing or unknown command is one
    line on stderr and exit code 1, as every other error (argparse prints its usage and exits
    2); ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"numaov: error: {self.prog.removeprefix('numaov ')}: {message}\n"
                  if self.prog != "numaov" else f"numaov: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="numaov",
        description="Run diffusion transformers and MoE language models on CPU servers with "
        "OpenVINO, one worker per NUMA node.",
    )
    parser.add_argument("--version", action="version", version=f"numaov {__version__}")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="library log level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_doctor_parser(sub)
    _add_demo_parser(sub)
    export = sub.add_parser("export", help="export a model to ONNX and OpenVINO IR")
    export_sub = export.add_subparsers(dest="model", required=True, metavar="MODEL")
    run = sub.add_parser("run", help="run an exported model")
    run_sub = run.add_subparsers(dest="model", required=True, metavar="MODEL")
    _add_export_wan_parser(export_sub)
    _add_run_wan_parser(run_sub)
    _add_export_lm_parser(export_sub)
    _add_run_lm_parser(run_sub)
    _add_serve_parser(sub)
    _add_bench_parsers(sub)
    return parser


def _with_flag(exc: NumaovError, args: argparse.Namespace) -> str:
    """The error's message, after the flag of the running command that sets the library
    parameter it is about (when there is one)."""
    parser = getattr(args, "command_parser", None)
    if exc.parameter is None or parser is None:
        return str(exc)
    flags = [a.option_strings[0] for a in parser._actions  # the parser's options
             if a.dest == exc.parameter and a.option_strings]
    return f"{flags[0]}: {exc}" if flags else str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries(args.log_level)
    try:
        return int(args.func(args) or 0)
    except NumaovError as exc:
        print(f"numaov: error: {_with_flag(exc, args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("numaov: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
