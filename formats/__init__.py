"""FTW: the on-disk contract between the compiler and the runtime (specs/ftw.md).

The names below load on first use (PEP 562), so that `ft.formats.layout` and the other torch-free modules import
without torch: a command can start reading the FTW's files before the heavy imports (`ft.formats.prefetch`)."""

from __future__ import annotations

import importlib

_WHERE = {"FAMILIES": "config", "ModelConfig": "config", "FtwError": "errors", "ExpertBankView": "reader",
          "FtwReader": "reader", "FtwWriter": "writer"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
