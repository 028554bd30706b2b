"""The README documents every command-line flag and every NUMAOV_* environment variable."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from numaov.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
# Names that look like variables but are compile-time names (C++ macros, CMake variables).
COMPILE_TIME = re.compile(r"NUMAOV_(TARGET_\w+|MEMORY_BARRIER|COLLECTIVE_DOMAIN|MOE_DOMAIN|OPENVINO_VERSION"
                          r"|\w+_CMAKE_DIR)$")


def _flags(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, str]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _flags(sub, f"{path} {name}")
        else:
            found += [(path, option) for option in action.option_strings
                      if option.startswith("--") and option not in ("--help", "--version")]
    return found


def test_every_flag_is_in_the_readme() -> None:
    missing = [f"{path}: {flag}" for path, flag in _flags(build_parser(), "numaov")
               if not re.search(rf"{re.escape(flag)}(?![\w-])", README)]
    assert not missing, f"flags the README does not mention: {missing}"


def test_every_environment_variable_is_in_the_readme() -> None:
    names = set()
    for path in [*(ROOT / "numaov").rglob("*.py"), *(ROOT / "numaov").rglob("*.cpp"),
                 *(ROOT / "numaov").rglob("*.hpp"), *(ROOT / "tests").rglob("*.py")]:
        names |= set(re.findall(r"NUMAOV_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    # Macros the C++ defines for itself (#define NUMAOV_...) are not environment variables.
    defined = {n for path in (ROOT / "numaov").rglob("*.[ch]pp")
               for n in re.findall(r"#define (NUMAOV_\w+)", path.read_text(encoding="utf-8"))}
    names = {n.rstrip("_") for n in names - defined if not COMPILE_TIME.match(n)}
    missing = sorted(n for n in names if f"`{n}`" not in README)
    assert not missing, f"NUMAOV_* variables the README does not list: {missing}"
