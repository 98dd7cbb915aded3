"""Run megatron-core on CPU, for tests and debugging (production runs on CUDA).

megatron-core assumes CUDA throughout: buffers are made with device="cuda" or on `torch.cuda.current_device()`,
tensors are moved with `.cuda()`, optimizers check for 'torch.cuda.*Tensor' types, pipeline exchanges call
`torch.cuda.synchronize()`, gradient buffers wait on `current_stream()`, the MoE all-to-all dispatcher copies
token counts to the host on a side stream, and attention forks the CUDA RNG tracker (for dropout, which the
mapped models do not use). While a call of the backend runs on CPU, a torch function mode turns every CUDA
device into the CPU and names CPU tensor types as CUDA ones, current_device() answers "cpu", every stream is one
that never waits, and the tracker forks nothing; all is restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class _CudaToCpu(TorchFunctionMode):
    """Every torch call asking for a CUDA device gets the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # optimizers check 'torch.cuda.*Tensor'
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_all_to_all_single = dist.all_to_all_single  # the process group's own, whatever the shims above it replaced


def _all_to_all_with_list_splits(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
    """The MoE dispatcher's split sizes are numpy arrays when copied from a GPU, but stay tensors on the CPU,
    which the process group does not take."""
    def as_list(sizes):
        return sizes.tolist() if torch.is_tensor(sizes) else sizes

    return _all_to_all_single(output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kwargs)


def _is_cuda(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _NoStream:
    """Stands in for the current CUDA stream: CPU work is already in order, so waiting is a no-op."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self) -> _NoStream:  # an event whose synchronize() returns at once
        return self


class _NoRngTracker:
    """Stands in for megatron's CUDA RNG tracker: dropout is 0, so there is no random state to fork."""

    def fork(self, name: str | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def is_initialized(self) -> bool:
        return False


_TRACKER = _NoRngTracker()
_STREAM = _NoStream()


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    # megatron-core is an optional dependency (the `megatron` extra): imported only when the shim is entered
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    saved = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream, torch.cuda.Stream,
             torch.cuda.stream, tensor_parallel.get_cuda_rng_tracker, tp_random.get_cuda_rng_tracker,
             dist.all_to_all_single, Dispatcher.cuda_dtoh_stream)
    # the dispatcher keeps its side stream in a class attribute: the shim's stream only while the shim is on
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # CPU work is synchronous
    torch.cuda.current_stream = lambda device=None: _STREAM  # type: ignore[assignment]  (megatron-core 0.19)
    torch.cuda.Stream = lambda *a, **k: _STREAM  # type: ignore[assignment,misc]  (the MoE dispatcher's side stream)
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker = lambda *a, **k: _TRACKER
    dist.all_to_all_single = _all_to_all_with_list_splits
    Dispatcher.cuda_dtoh_stream = _STREAM
    try:
        with _CudaToCpu():
            yield
    finally:
        (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream, torch.cuda.Stream,
         torch.cuda.stream, tensor_parallel.get_cuda_rng_tracker, tp_random.get_cuda_rng_tracker,
         dist.all_to_all_single, Dispatcher.cuda_dtoh_stream) = saved


def device_context(device: str) -> contextlib.AbstractContextManager:
    """cpu_shim() on CPU, nothing on CUDA."""
    return cpu_shim() if device == "cpu" else contextlib.nullcontext()
