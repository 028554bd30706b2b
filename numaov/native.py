"""Where the native library lives and how it is loaded.

`libnumaov.so` holds the shared-memory communicator and the OpenVINO extension
ops; `_native` is its Python binding. The build installs both in
`numaov/custom_ops/`, so the package finds them itself: nothing is looked up by a
hard-coded path. A leaf module (it imports only the base error) at the package's
top, because both the ops (`custom_ops`) and the communicator (`distributed`)
load the library: neither package has to import the other to reach it.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from types import ModuleType

from numaov import NumaovError

LIBRARY_NAME = "libnumaov.so"


class NativeLibraryError(NumaovError):
    """The native library is missing, or was built for another OpenVINO."""


@functools.cache
def native_module() -> ModuleType:
    """Import the binding, checking it was built against the running OpenVINO."""
    import openvino  # loads libopenvino first, so the binding resolves against it

    try:
        module = importlib.import_module("numaov.custom_ops._native")
    except ImportError as exc:
        raise NativeLibraryError(
            f"the numaov native library is not built or cannot load ({exc}); "
            "expected it installed with the package: run `make install` (or `pip install -e .`)"
        ) from exc
    running = openvino.get_version().split("-")[0]
    built = module.openvino_build_version
    if not running.startswith(built):
        raise NativeLibraryError(
            f"the numaov native library was built against OpenVINO {built} but OpenVINO "
            f"{running} is running; expected the same release: rebuild with `make install`"
        )
    return module


def library_path() -> Path:
    """Absolute path of `libnumaov.so`, for `openvino.Core.add_extension`."""
    path = Path(native_module().__file__).with_name(LIBRARY_NAME)
    if not path.is_file():
        raise NativeLibraryError(f"{LIBRARY_NAME} not found next to the binding at {path.parent}")
    return path


def add_extension(core) -> None:
    """Load numaov's extension ops into an `openvino.Core`."""
    core.add_extension(str(library_path()))
