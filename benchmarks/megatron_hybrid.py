"""A megatron actor's train → generate transition: the 3D-HybridEngine against gathering the whole model.

    python benchmarks/megatron_hybrid.py --layouts 1,2:1 2,2:1 2,2:2,1

Each layout `p,t:t_g` (or `p,t:p_g,t_g`) spawns p·t gloo processes on 127.0.0.1 (d = 1), builds a megatron-core GPTModel
shard of one Llama-shaped model (random weights, float32) on each (megatron-core on CPU needs the test-only CUDA shim,
tests/engines/megatron_shim.py, applied first: a measurement on CPU, not a product path), and times, rounds
interleaved, (a) `MegatronEngine.hybrid_engine(...).generation_model()` + `release()` — copy of the rank's shard
out of megatron's buffers, all-gather inside the micro-DP group — and (b) `full_state_dict()`, what a megatron
actor without `rollout_tp` does before generating (every shard to every rank). A round's time is the slowest
rank's; the figure is the median. Bytes: (a) as the resharder counts what each rank received, plus the shard copy
it holds while generating; (b) every other rank's shard. Prints a table per layout, with Table 2's micro-DP bytes
(engines.hybrid.accounting: the sharded payloads of the micro-DP peers plus the replicated tensors of other stages).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model():
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=2048,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _run(rank: int, world: int, port: int, pp: int, tp: int, gen_pp: int, gen_tp: int, rounds: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tests.engines import megatron_shim

    megatron_shim.apply()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import DeviceMesh

    from engines.hybrid.actor import HybridEngine, layout_of
    from engines.training.common import OptimConfig
    from engines.training.megatron.engine import MegatronEngine

    model = _model()
    engine = MegatronEngine.from_hf_model(model, OptimConfig(), tp=tp, pp=pp)
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(pp, 1, tp), mesh_dim_names=("pp", "dp", "tp"))
    mine = {}
    for ranks in HybridEngine.process_groups(layout_of((pp, 1, tp), gen_tp, gen_pp)):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine[ranks] = group
    hybrid = engine.hybrid_engine(model, mesh, gen_tp, mine, gen_pp=gen_pp)
    own = sum(
        v.numel() * v.element_size() for k, v in engine.module.state_dict().items() if not k.endswith("_extra_state")
    )
    times = {"hybrid": [], "gather": []}
    for _ in range(rounds):
        for method in ("hybrid", "gather"):
            dist.barrier()
            t0 = time.perf_counter()
            if method == "hybrid":
                hybrid.generation_model()
                stats, extra = hybrid.stats, hybrid.extra_generation_bytes
                hybrid.release()
            else:
                full = engine.full_state_dict()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[method].append(float(took))
    from engines.hybrid.accounting import expected_received_bytes

    model_bytes = sum(v.numel() * v.element_size() for v in full.values())
    row = {
        "received": stats.received_bytes,
        "table2": expected_received_bytes(hybrid.geometry, hybrid.layout, hybrid.rank, "micro-dp", 4),
        "extra": extra,
        "redundant": stats.redundant_bytes,
        "hybrid_s": statistics.median(times["hybrid"]),
        "gather_s": statistics.median(times["gather"]),
        "gather_received": model_bytes - own,
        "model_bytes": model_bytes,
    }
    out[rank] = row
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--layouts", nargs="+", default=["1,2:1", "2,2:1", "2,2:2,1"], help="p,t:t_g or p,t:p_g,t_g per run (d = 1)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(
        f"{'(p,t)->(p_g,t_g)':<16} {'rank':>4} {'hybrid recv MB':>15} {'Table 2 MB':>11} {'held extra MB':>14} "
        f"{'redundant':>9} {'gather recv MB':>15} {'hybrid s':>9} {'gather s':>9} {'ratio':>6}"
    )
    for spec in args.layouts:
        sizes, gen = spec.split(":")
        pp, tp = (int(x) for x in sizes.split(","))
        gen_pp, gen_tp = (int(x) for x in gen.split(",")) if "," in gen else (1, int(gen))
        world = pp * tp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.Manager().dict()
        mp.spawn(_run, args=(world, port, pp, tp, gen_pp, gen_tp, args.rounds, out), nprocs=world, join=True)
        for rank in range(world):
            r = out[rank]
            print(
                f"{f'({pp},{tp})->({gen_pp},{gen_tp})':<16} {rank:>4} {r['received'] / 1e6:>15.2f} {r['table2'] / 1e6:>11.2f} "
                f"{r['extra'] / 1e6:>14.2f} {r['redundant']:>9} {r['gather_received'] / 1e6:>15.2f} "
                f"{r['hybrid_s']:>9.4f} {r['gather_s']:>9.4f} {r['hybrid_s'] / r['gather_s']:>6.2f}"
            )


if __name__ == "__main__":
    main()
