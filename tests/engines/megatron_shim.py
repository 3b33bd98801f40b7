"""Test-only CUDA shim: lets megatron-core 0.16.1 run on CPU processes with gloo. Never imported by the package.

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths: tensors created with
``device="cuda"`` or ``device=torch.cuda.current_device()`` (the schedules' token counter, the optimizer's
found-inf and grad-norm buffers, the DDP buffers), ``.cuda()`` calls, ``param.type() == 'torch.cuda.FloatTensor'``
checks in the optimizers and grad clipping, and the CUDA RNG tracker forked around attention dropout. `apply()`
redirects exactly those to CPU, in the calling process only:

* a `TorchFunctionMode` rewrites a CUDA ``device`` (keyword, or positional in ``Tensor.to``) to CPU, makes
  ``Tensor.cuda()`` the identity, drops ``pin_memory``, and reports CPU float tensors under their CUDA type names;
* ``torch.cuda.current_device`` returns 0 (which the mode then maps to CPU), and the stream/synchronize calls are
  no-ops;
* the RNG tracker records its named states without touching CUDA generators, and ``fork()`` just yields (the test
  models have no dropout, so there is no RNG stream to keep apart).

Apply it at the start of each spawned test process, before megatron builds anything. Everything else (the model,
the parallel layers, the schedules, DDP, the distributed optimizer, the collectives over gloo) is megatron-core's
own code, unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply"]

_applied = False


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA device in torch's API
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and kwargs["device"] is not None and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def apply() -> None:
    """Install the redirections in this process (idempotent)."""
    global _applied
    if _applied:
        return
    _applied = True
    import warnings

    # Every tensor attribute read passes through the mode below, so torch's warning about reading `.grad` of a
    # non-leaf (megatron reads it on its buffers' views, where it is None as intended) fires here; it never
    # does without the shim.
    warnings.filterwarnings(
        "ignore", message=r"The \.grad attribute of a Tensor that is not a leaf", category=UserWarning
    )
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None

    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.empty(0)

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        yield

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    torch.cuda.manual_seed = lambda seed: None
    _CudaToCpu().__enter__()  # for the life of the process
