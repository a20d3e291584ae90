"""flashloss's integrations with other libraries, in one place: TRL (:mod:`.trl`), verl
(:mod:`.verl`, :mod:`.verl_autopatch`), Liger-Kernel's GRPO conventions (:mod:`.liger`),
transformers (:mod:`.transformers`) and Tunix (:mod:`.tunix`). Each is importable by its
old name too (``flashloss.trl``, ``flashloss.verl``, ...): that module is this package's
(:func:`alias`). The bindings they run on are :mod:`flashloss.torch` and
:mod:`flashloss.jax`."""

from __future__ import annotations

import importlib
import sys


def alias(name: str) -> None:
    """Makes the module ``flashloss.NAME`` be ``flashloss.integrations.NAME``: the same
    module object, so an attribute set on one (a patch, a monkeypatch) is set on both."""
    sys.modules[f"flashloss.{name}"] = importlib.import_module(f"{__name__}.{name}")
