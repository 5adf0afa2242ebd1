"""Package attributes that load on first use (PEP 562).

Some package ``__init__`` files of m2nkit re-export names whose modules import
torch; loading them lazily keeps the light modules beside them (spec parsers,
placements, the family registry) importable without torch, so the CLI refuses
bad input before any heavy import.
"""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def lazy_attributes(package: str, table: Mapping[str, tuple[str, str]],
                    namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` from ``{name: (module, attribute)}``.

    ``module`` may be relative to ``package``; a loaded name is cached in
    ``namespace`` (the package's ``globals()``).
    """

    def __getattr__(name: str):
        try:
            module, attr = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module, package), attr)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
