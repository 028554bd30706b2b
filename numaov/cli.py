"""The `numaov` command line: a thin shell over the library.

Each subcommand is a `cmd_*` function taking the parsed arguments and
returning an exit code; formatting functions in the library return strings
and only this module prints. `main()` is the one place that catches
`NumaovError`, prints it as one line and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from numaov import NumaovError, __version__


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines go to stderr, so stdout stays clean for results."""
    if getattr(args, "quiet", False):
        return None
    return lambda message: print(f"numaov: {message}", file=sys.stderr, flush=True)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress output")


# -- doctor -------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from numaov.runtime.doctor import collect_report, format_report

    report = collect_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="report topology, ISA, binding plan, OpenVINO and /dev/shm")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_doctor)


# -- parser and entry point ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    export = sub.add_parser("export", help="export a model to ONNX and OpenVINO IR")
    export_sub = export.add_subparsers(dest="model", required=True, metavar="MODEL")
    run = sub.add_parser("run", help="run an exported model")
    run_sub = run.add_subparsers(dest="model", required=True, metavar="MODEL")
    del export_sub, run_sub
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except NumaovError as exc:
        print(f"numaov: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("numaov: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
