"""The engine's optional Triton kernels, looked up once: present on CUDA machines with Triton, absent elsewhere
(CPU installs of torch ship without Triton), where the torch path of the same operation runs instead."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable


@functools.cache
def triton_kernel(module: str, name: str) -> Callable | None:
    """`module.name` from rlflow.engines.models, or None when it does not import (no Triton)."""
    try:
        return getattr(importlib.import_module(f"rlflow.engines.models.{module}"), name)
    except (ImportError, AttributeError) as exc:  # optional: every caller has a torch path
        logging.getLogger(__name__).info("%s.%s unavailable (%s); the torch path runs", module, name, exc)
        return None
