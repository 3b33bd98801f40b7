"""Checkpoint save and load throughput against a plain copy of the same bytes on the same disk, in one run.

    python benchmarks/checkpoint.py [--mb 384] [--repeats 3] [--dir /tmp]

The state is a model-plus-AdamW-shaped dict of float32 tensors (parameters, exp_avg, exp_avg_sq), ``--mb`` in all.

- ``save``: ``store.begin`` → ``save_sharded`` (torch.distributed.checkpoint, checksummed as written, fsynced)
  → ``store.commit`` (controller state, manifest, rename, ``latest``, retention; the previous checkpoint's space
  is freed in the background, outside the timing).
- ``copy-write``: the same tensor bytes written into one plain file from memory, then fsynced.
- ``load``: ``store.latest_complete()`` (manifest, sizes and CRC-32 of every byte) → ``load_sharded`` into
  preallocated tensors of the same shapes.
- ``copy-read``: the plain file read with ``readinto`` straight into preallocated tensors of the same shapes.

Reads: page caches cannot be dropped without root, so before each timed read (``load`` and ``copy-read`` alike)
the files to be read are evicted from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (they were
fsynced, so their pages are clean and do get dropped). Both reads therefore start from the device; on a virtual
disk the host may still cache below the guest. The copy is the strictest baseline: one file, one pass, no
checksum, no format.

Each operation runs ``--repeats`` times, interleaved, with the copy and the checkpoint taking turns to go first
(a repeat writes, then reads). The table shows the median and the best of each, and the ratios to the plain copy
of medians and of bests, against the target ratio 0.5 from issue 7. The load average is printed before and
after: on a shared machine the spread between repeats is mostly other people's work, and fsync latency varies
most of all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flowactors.checkpoint import CheckpointStore, capture_rng, load_sharded, save_sharded

TARGET = 0.5


def make_state(total_mb: int) -> dict[str, dict[str, torch.Tensor]]:
    """Parameters and two AdamW moments, as 4 MiB-to-16 MiB float32 tensors, ``total_mb`` MiB in all."""
    per_kind = (total_mb << 20) // 3
    shapes, used = [], 0
    while used < per_kind:
        rows = 4096 if len(shapes) % 2 == 0 else 1024  # mixed sizes, like a model's matrices and norms
        rows = min(rows, max(1, (per_kind - used) // (1024 * 4)))
        shapes.append((rows, 1024))
        used += rows * 1024 * 4
    generator = torch.Generator().manual_seed(0)
    return {
        kind: {f"layer{i}.weight": torch.randn(shape, generator=generator) for i, shape in enumerate(shapes)}
        for kind in ("model", "exp_avg", "exp_avg_sq")
    }


def like(state: dict) -> dict:
    return {kind: {name: torch.empty_like(t) for name, t in tensors.items()} for kind, tensors in state.items()}


def tensors_of(state: dict) -> list[torch.Tensor]:
    return [t for kind in state.values() for t in kind.values()]


def evict(path: Path) -> None:
    """Drop the page-cache pages of ``path`` (a file, or every file under a directory)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def copy_write(state: dict, path: Path) -> float:
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for tensor in tensors_of(state):
            f.write(tensor.numpy().data.cast("B"))
        os.fsync(f.fileno())
    return time.perf_counter() - started


def copy_read(target: dict, path: Path) -> float:
    evict(path)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for tensor in tensors_of(target):
            view = tensor.numpy().data.cast("B")
            while view:
                view = view[f.readinto(view) :]
    return time.perf_counter() - started


def save(store: CheckpointStore, state: dict, step: int, threads: int) -> tuple[float, float]:
    started = time.perf_counter()
    pending = store.begin(step)
    save_sharded(state, pending.role_dir("actor"), thread_count=threads)
    commit_started = time.perf_counter()
    store.commit(pending, {"data": {"epoch": 0, "index_in_epoch": step, "shuffle_seed": 0}, "rng": capture_rng()})
    done = time.perf_counter()
    return done - started, done - commit_started


def load(store: CheckpointStore, target: dict, threads: int) -> tuple[float, float]:
    evict(store.latest())
    started = time.perf_counter()
    checkpoint = store.latest_complete()
    verified = time.perf_counter()
    load_sharded(target, checkpoint.role_dir("actor"), thread_count=threads)
    return time.perf_counter() - started, verified - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=384, help="MiB of tensor data in the state")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (one filesystem for all)")
    parser.add_argument("--threads", type=int, default=2, help="save_sharded / load_sharded thread_count")
    args = parser.parse_args()

    state = make_state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    work = Path(tempfile.mkdtemp(prefix="flowactors-ckpt-bench-", dir=args.dir))
    store = CheckpointStore(work / "ckpt", keep_last=1)
    plain = work / "plain.bin"
    load_before = f"{os.getloadavg()[0]:.2f}"
    print(
        f"# {nbytes / 1e6:.0f} MB in {len(tensors_of(state))} float32 tensors; dir {work}; {os.cpu_count()} CPUs; "
        f"torch {torch.__version__}; Python {platform.python_version()}; io_threads {store.io_threads}; "
        f"DCP threads {args.threads}; "
        "reads start from an evicted page cache (posix_fadvise DONTNEED)"
    )

    times: dict[str, list[float]] = {"copy-write": [], "save": [], "copy-read": [], "load": []}
    extra: dict[str, list[float]] = {"commit": [], "verify": []}

    def run_copy_write(repeat: int) -> None:
        times["copy-write"].append(copy_write(state, plain))

    def run_save(repeat: int) -> None:
        seconds, commit = save(store, state, step=repeat + 1, threads=args.threads)
        times["save"].append(seconds)
        extra["commit"].append(commit)
        store.close()  # retention frees the previous checkpoint in the background; not under the next timing

    def run_copy_read(repeat: int) -> None:
        target = like(state)
        times["copy-read"].append(copy_read(target, plain))
        assert all(torch.equal(a, b) for a, b in zip(tensors_of(state), tensors_of(target)))

    def run_load(repeat: int) -> None:
        target = like(state)
        seconds, verify = load(store, target, threads=args.threads)
        times["load"].append(seconds)
        extra["verify"].append(verify)
        assert all(torch.equal(a, b) for a, b in zip(tensors_of(state), tensors_of(target)))

    try:
        for repeat in range(args.repeats):
            if repeat % 2 == 0:
                order = (run_copy_write, run_save, run_copy_read, run_load)
            else:
                order = (run_save, run_copy_write, run_load, run_copy_read)
            for step in order:
                step(repeat)
            commit, verify = extra["commit"][-1], extra["verify"][-1]
            for op in times:
                record = {
                    "op": op,
                    "bytes": nbytes,
                    "seconds": round(times[op][-1], 4),
                    "MBps": round(nbytes / 1e6 / times[op][-1], 1),
                }
                if op == "save":
                    record["commit_seconds"] = round(commit, 4)
                if op == "load":
                    record["verify_seconds"] = round(verify, 4)
                print(json.dumps(record), flush=True)
            plain.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    median = {op: statistics.median(values) for op, values in times.items()}
    best = {op: min(values) for op, values in times.items()}
    baseline = {"save": "copy-write", "load": "copy-read"}
    print()
    print(f"# load average {load_before} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
    print(
        f"{'op':<11} {'MB':>5} {'median s':>9} {'MB/s':>6} {'best s':>7} {'MB/s':>6}  "
        f"ratio vs plain copy: median, best (target >= {TARGET})"
    )
    for op in ("copy-write", "save", "copy-read", "load"):
        mb = nbytes / 1e6
        line = f"{op:<11} {mb:>5.0f} {median[op]:>9.3f} {mb / median[op]:>6.0f} {best[op]:>7.3f} {mb / best[op]:>6.0f}"
        if op in baseline:
            ratio = median[baseline[op]] / median[op]
            ratio_best = best[baseline[op]] / best[op]
            verdict = "ok" if ratio >= TARGET else "BELOW TARGET"
            line += f"  {ratio:.2f}x, {ratio_best:.2f}x of {baseline[op]}  {verdict}"
        print(line)
    print(
        f"# of which: commit (checksum + manifest + rename) {statistics.median(extra['commit']):.3f} s; "
        f"verify (CRC-32 of every byte) {statistics.median(extra['verify']):.3f} s"
    )


if __name__ == "__main__":
    main()
