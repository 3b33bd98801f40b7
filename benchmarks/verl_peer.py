"""verl's side of `benchmarks/dispatch.py --verl-python PATH`: a verl 0.9.1 worker group of 2 Ray actors on CPU.

Run by dispatch.py with the interpreter of verl's own environment (verl pins its own torch, transformers and Ray);
it is not part of the package and imports nothing from it. Cases, as dispatch.py's flowactors rows: `noop` (a
ONE_TO_ALL call with no data, awaited) and `split4MiB` (a 1024 x 512 int64 DataProto through DP_COMPUTE_PROTO:
split over the 2 workers, touched, gathered back). Prints one JSON object per case.

    RAY_AUTH_MODE=disabled PATH/python benchmarks/verl_peer.py --repeats 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 would otherwise write a token file in $HOME

import ray
import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


@ray.remote
class Echo(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def touch(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"input_ids": data.batch["input_ids"]})


def _timed(fn, repeats: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=Echo), device_name="cpu")
        data = DataProto.from_dict(
            tensors={"input_ids": torch.arange(1024 * 512, dtype=torch.int64).reshape(1024, 512)}
        )
        out = group.touch(data)
        if not torch.equal(out.batch["input_ids"], data.batch["input_ids"]):
            raise SystemExit("verl's split + gather did not return the batch")
        for case, fn in (("noop", group.noop), ("split4MiB", lambda: group.touch(data))):
            times = sorted(_timed(fn, args.repeats))
            print(
                json.dumps(
                    {
                        "system": "verl",
                        "case": case,
                        "median_ms": round(statistics.median(times) * 1e3, 3),
                        "p90_ms": round(times[int(0.9 * len(times))] * 1e3, 3),
                        "controller_bytes": None,
                    }
                ),
                flush=True,
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
