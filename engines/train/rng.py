"""A train rank's random number generators as JSON values, for checkpoints (no pickle: a stored file is data).

A resumed run draws the numbers an uninterrupted one would: Python's, numpy's and torch's CPU generators, and on
a GPU the CUDA generator of the rank's device (dropout, sampling on the device). The CUDA state is read only when
this process has initialised CUDA: a CPU run never starts a CUDA context to save it.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


def rng_state() -> dict:
    """Python, numpy and torch CPU RNG state, and the current CUDA device's when CUDA is in use, as JSON values."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()  # the current device: a rank drives one GPU
    return state


def set_rng_state(state: dict) -> None:
    """Restore rng_state()'s values. A CUDA state goes to the current CUDA device (applied when CUDA initialises,
    if it has not yet); without CUDA here it is skipped with a warning: resuming a GPU run on CPU is allowed, and
    a CPU checkpoint resumed on a GPU keeps the device's seeded generator."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" not in state:
        return
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
    else:
        log.warning("the checkpoint's CUDA RNG state is not restored: this process has no CUDA device")


def restore_rng(state: dict, source: str | Path) -> None:
    """set_rng_state from the `rng` field of a checkpoint's JSON file `source`, a damaged one named in the error."""
    try:
        set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {source}: field 'rng' is not an RNG state rlflow saved ({e!r})") from None
