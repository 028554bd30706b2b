"""A family's config as a frozen dataclass of Hugging Face ``config.json`` keys: built from the
mapping (keys it does not read kept in ``extra``, so ``to_dict`` writes them back), written
back, and the checks every family's config makes of its values."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, fields
from typing import Any, NoReturn, TypeVar

from numaov import NumaovError

Config = TypeVar("Config")
#: Raises the family's config error with one line.
Fail = Callable[[str], NoReturn]


def config_from_keys(cls: type[Config], values: Mapping[str, Any], what: str,
                     error: type[NumaovError], *, derived: Mapping[str, Any],
                     also_read: Collection[str] = (), null_is_default: bool = False) -> Config:
    """The dataclass ``cls`` from a ``config.json`` mapping: each field from the key of its
    name, those in ``derived`` (rope read from either spelling, renamed keys) from there
    instead; the keys not read (nor in ``also_read``, nor ``rope_parameters``) go to
    ``extra``. With ``null_is_default`` a null key takes the field's default.

    A wrongly typed value that breaks the dataclass's own checks raises ``error``.
    """
    names = {f.name for f in fields(cls)} - {"extra"} - set(derived)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {k: values[k] for k in names
                              if k in values and not (null_is_default and values[k] is None)}
    kwargs.update(derived)
    used = names | set(derived) | {"rope_parameters"} | set(also_read)
    kwargs["extra"] = {k: v for k, v in values.items() if k not in used}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a wrongly typed value that broke arithmetic in the checks
        raise error(f"{what}: {exc}") from exc


def config_to_keys(config: Any, architecture: str, **fixed: Any) -> dict[str, Any]:
    """The ``config.json`` form of a config dataclass: the keys it did not read, its fields,
    the ``fixed`` keys, and ``architectures`` unless the checkpoint named them."""
    out = dict(config.extra)
    out.update({k: v for k, v in asdict(config).items() if k != "extra"})
    out.update(fixed)
    out.setdefault("architectures", [architecture])
    return out


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON's true is no layer count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(config: Any, names: Iterable[str], fail: Fail, *,
                   null_ok: bool = False) -> None:
    """Each of the ``names`` fields is a positive integer (or null, with ``null_ok``)."""
    for name in names:
        value = getattr(config, name)
        if null_ok and value is None:
            continue
        if not is_int(value) or value < 1:
            fail(f"{name} is {value!r}; expected a positive integer"
                 + (" or null" if null_ok else ""))


def check_silu(config: Any, fail: Fail) -> None:
    """The MLPs and experts are SwiGLU: the one activation they compute."""
    if config.hidden_act != "silu":
        fail(f"hidden_act is {config.hidden_act!r}; expected 'silu'")
