"""Asynchronous RL's weight sync, trainer → rollout replicas: the rank-0 path against the sharded one, in one run.

    python benchmarks/weight_sync.py [--json] [--sizes 50,200,400] [--bucket-mb 64] [--cluster]

An embedded 4-slot cluster: the trainer an FSDP2 actor over 2 ranks, the replicas 2 ranks of whole copies (what
`async_staleness=K` builds), or one replica of generation TP 2 (`rollout_tp=2`: each rank receives its shard).
For Llama-shaped models of about 50M, 200M and 400M parameters (float32), each path syncs the trainer's weights
twice (the second is timed): `rank0`
(`policy_weights` gathered on trainer rank 0 into `load_policy` on every replica rank) and `sharded`
(`send_policy` / `receive_policy` over a link, buckets of `--bucket-mb`). Per path: seconds, the bytes each trainer
rank sent (rank 0's link carries everything on the old path), and each rank's peak resident memory growth during
the sync (VmHWM after resetting it, minus VmRSS before). LoRA (rank 8 on every linear layer, the middle size): the
bytes of a sharded sync after the first, against the full model's. `--cluster` estimates syncs of 7B/70B/235B models on
64-512 GPUs from a per-link bandwidth, beside verl's and slime's published figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines import ActorWorker  # noqa: E402
from engines.rollout.replica import sync_subgroups  # noqa: E402
from flowactors import ONE_TO_ALL, endpoint  # noqa: E402

SIZES = {50: (640, 10), 200: (1024, 16), 400: (1280, 20)}
"""About this many million parameters → (hidden size, layers) of a Llama (grouped-query attention, MLP 8/3 wide);
the tiny character vocabulary adds next to nothing."""


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class MeasuredActor(ActorWorker):
    """The actor with two endpoints that bracket a call's resident memory growth on each rank."""

    @endpoint(protocol=ONE_TO_ALL)
    def rss_mark(self) -> int:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self._rss0 = _status("VmRSS")
        return self._rss0

    @endpoint(protocol=ONE_TO_ALL)
    def rss_growth(self) -> int:
        return max(0, _status("VmHWM") - self._rss0)


def _model(size: int):
    from engines import ModelConfig

    hidden, layers = SIZES[size]
    return ModelConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 64,
        num_kv_heads=hidden // 128,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        max_position_embeddings=256,
        pad_vocab_to=2,  # a replica with generation TP 2 splits the vocabulary
    )


def measure(ctl, size: int, bucket_mb: float, lora: int = 0, replica_tp: int = 1) -> list[dict]:
    import flowactors as fa
    from engines import OptimConfig
    from flowactors import Layout

    model = _model(size)
    trainer = fa.ActorGroup(
        ctl,
        MeasuredActor,
        name=f"trainer{size}_{lora}",
        slots=ctl.slots[:2],
        layout=Layout(dp=2),
        args=(model, OptimConfig(zero_stage=3, lora_rank=lora)),
    )
    replicas = fa.ActorGroup(  # two whole copies, or one replica of TP 2 (the 3D-HybridEngine's shards)
        ctl,
        MeasuredActor,
        name=f"replicas{size}_{lora}_{replica_tp}",
        slots=ctl.slots[2:4],
        layout=Layout(dp=2 // replica_tp, tp=replica_tp),
        args=(
            model,
            OptimConfig(zero_stage=1, lora_rank=lora if lora else 0),
            None,
            replica_tp if replica_tp > 1 else None,
        ),
    )
    rows = []
    try:
        n_params = sum(trainer.memory_stats().result()[r]["param_bytes"] for r in range(2)) // 4
        link = ctl.link(f"bench{size}_{lora}_{replica_tp}", [trainer, replicas], sync_subgroups(2, replicas.layout))
        bucket = int(bucket_mb * 2**20)
        # rank0 last: it may not survive a large model; a TP replica takes its shards by the sharded path only
        paths = ("sharded",) if lora or replica_tp > 1 else ("sharded", "rank0")
        for path in paths:
            for attempt in range(2):  # the first builds plans and buffers; the second is measured
                changed = bool(lora) and attempt == 1
                trainer.rss_mark().result(), replicas.rss_mark().result()
                t0 = time.perf_counter()
                if path == "rank0":
                    try:
                        got = replicas.load_policy(trainer.policy_weights(), attempt).result()
                    except fa.WorkerLostError as e:  # rank 0's second copy (and its serialisation) outgrew the worker
                        rows.append({"size_m": size, "params": n_params, "path": path, "error": str(e)[:160]})
                        return rows
                    sent = [sum(g["bytes"] for g in got), 0.0]  # every replica's copy leaves trainer rank 0
                else:
                    s = trainer.send_policy(link, bucket, changed)
                    got = replicas.receive_policy(link, bucket, attempt, changed).result()
                    sent = [r["bytes"] for r in s.result()]
                seconds = time.perf_counter() - t0
                growth = trainer.rss_growth().result() + replicas.rss_growth().result()
            rows.append(
                {
                    "size_m": size,
                    "params": n_params,
                    "path": path + (f"+lora{lora}" if lora else "") + (f"+tp{replica_tp}" if replica_tp > 1 else ""),
                    "seconds": round(seconds, 3),
                    "bytes_per_replica": got[0]["bytes"],  # per replica rank (a TP rank: its shard)
                    "sent_by_trainer_rank": sent,
                    "peak_growth_mb_per_rank": [round(g / 2**20, 1) for g in growth],
                    "bucket_mb": bucket_mb,
                }
            )
    finally:
        for group in (trainer, replicas):
            try:
                group.close(wait=False)
            except fa.FlowactorsError:  # a group on a worker that died
                pass
    return rows


PUBLISHED = [  # (system, model, GPUs, seconds, how) from their own documentation and reports
    ("verl (rank-0 staging)", "Qwen3-235B", 256, 256.0, "246-266 s"),
    ("verl (sharded)", "Qwen3-235B", 256, 13.0, "11-15 s"),
    ("slime", "GLM-4.5-355B", 256, 48.0, "48 s"),
    ("checkpoint-engine", "Kimi-K2 1T", 256, 20.0, "~20 s"),
]


def cluster_estimate(bytes_per_s: float) -> list[dict]:
    """Sync time from a per-link bandwidth: rank 0 gathers the model and sends it to each replica's ranks over its
    one link (M x (1 + R) bytes through one link); sharded, each replica rank takes its generation shard once
    (M / t_g bytes over its own link), the trainer's ranks sending in parallel. bf16 weights, replicas of t_g = 8."""
    out = []
    for name, params in (("7B", 7e9), ("70B", 70e9), ("235B", 235e9)):
        m = 2 * params
        for gpus in (64, 128, 256, 512):
            replicas = gpus // 2 // 8  # half the GPUs roll out, in replicas of 8
            out.append(
                {
                    "model": name,
                    "gpus": gpus,
                    "rank0_s": round(m * (1 + replicas * 8) / bytes_per_s, 1),
                    "sharded_s": round(m / 8 / bytes_per_s, 2),
                }
            )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", default="50,200,400")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument(
        "--lora", type=int, default=8, help="LoRA rank of the adapters-only row, on the middle size (0: none)"
    )
    ap.add_argument("--cluster", action="store_true", help="also estimate large clusters' syncs")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="GB/s per link for --cluster")
    args = ap.parse_args(argv)
    import flowactors as fa

    rows: list[dict] = []
    sizes = [int(s) for s in args.sizes.split(",")]
    lora_size = sorted(sizes)[len(sizes) // 2]  # the middle size (200M by default)
    tp_sizes = [s for s in sizes if (SIZES[s][0] // 128) % 2 == 0]  # TP 2 splits the KV heads: an even number
    runs = (
        [(s, 0, 1) for s in sizes] + [(s, 0, 2) for s in tp_sizes] + ([(lora_size, args.lora, 1)] if args.lora else [])
    )
    for size, lora, tp in runs:
        # a cluster per size: a worker the rank-0 path kills does not take the next sizes with it
        with fa.Controller.local(4, dashboard=None, collective_timeout_s=600) as ctl:
            rows += measure(ctl, size, args.bucket_mb, lora=lora, replica_tp=tp)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    print(
        f"\n{'size':>6} {'path':>14} {'seconds':>8} {'MB/replica':>11} {'MB sent by trainer ranks':>25} {'peak growth MB/rank':>28}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['size_m']:>5}M {r['path']:>14}   failed: {r['error']}")
            continue
        sent = "/".join(f"{b / 2**20:.0f}" for b in r["sent_by_trainer_rank"])
        growth = "/".join(f"{g:.0f}" for g in r["peak_growth_mb_per_rank"])
        print(
            f"{r['size_m']:>5}M {r['path']:>14} {r['seconds']:>8.2f} {r['bytes_per_replica'] / 2**20:>11.1f} "
            f"{sent:>25} {growth:>28}"
        )
    by = {(r["size_m"], r["path"]): r for r in rows if "seconds" in r}
    for size in sorted({r["size_m"] for r in rows}):
        if (size, "rank0") in by and (size, "sharded") in by:
            ratio = by[(size, "sharded")]["seconds"] / by[(size, "rank0")]["seconds"]
            print(f"{size}M: sharded / rank0 time = {ratio:.2f}")
        if (size, "sharded") in by and (size, "sharded+tp2") in by:
            share = by[(size, "sharded+tp2")]["bytes_per_replica"] / by[(size, "sharded")]["bytes_per_replica"]
            print(f"{size}M: a TP-2 replica rank receives {share:.3f} of a whole copy's bytes")
    lora = next((r for r in rows if "+lora" in r.get("path", "")), None)
    full = next((r for r in rows if r.get("path") == "sharded" and lora and r["size_m"] == lora["size_m"]), None)
    if full and lora:
        print(
            f"LoRA rank {args.lora}: a sync after the first moves {lora['bytes_per_replica'] / 2**20:.2f} MB = "
            f"{100 * lora['bytes_per_replica'] / full['bytes_per_replica']:.2f} % of the full model's"
        )
    if args.cluster:
        est = cluster_estimate(args.link_gbps * 1e9)
        print(f"\nestimated at {args.link_gbps:g} GB/s per link (bf16; replicas of TP 8 on half the GPUs):")
        print(f"{'model':>6} {'GPUs':>5} {'rank0 s':>9} {'sharded s':>10}")
        for e in est:
            print(f"{e['model']:>6} {e['gpus']:>5} {e['rank0_s']:>9} {e['sharded_s']:>10}")
        print("published: " + "; ".join(f"{s} {m} on {g} GPUs: {how}" for s, m, g, _, how in PUBLISHED))
        rows += [{"cluster": e} for e in est]
    return rows


if __name__ == "__main__":
    main()
