"""The megatron-core engine against plain transformers, on gloo process groups of spawned CPU processes.

megatron-core runs in `torch.multiprocessing.spawn`ed processes that apply the CUDA shim
(tests/engines/megatron_shim.py) first; the references (a transformers forward, a torch AdamW step) run in the
pytest process, which never sees the shim. One spawn of two processes runs every two-rank layout in turn
(TP=2, PP=2, DP=2; each engine builds its own process groups), one spawn of one process the TP=1/PP=1
baseline, so the file costs two process start-ups.

Adam's first step moves each weight by lr·g/(|g| + eps) with eps = 1e-8: where the reference gradient is itself
within float noise of eps (well under 0.1 % of the elements) the step's size is noise in any implementation, so
weights are compared at 1e-5 where |g| > 1e-6 and only against Adam's bound (lr) elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.ops import entropy_from_logits, position_ids_from_mask, response_logits, token_log_probs
from engines.training.megatron.convert import check_megatron_fits, hf_to_megatron, megatron_geometry, megatron_to_hf
from engines.training.megatron.engine import megatron_available
from flowactors import Batch
from tests.ranks import free_port, join_world, leave_world

needs_megatron = pytest.mark.skipif(
    not megatron_available(), reason="megatron-core is not installed (pip install '.[megatron]')"
)

LR, MICRO_BATCH_TOKENS = 1e-2, 20  # fixed_batch rows are 10 tokens wide: 2 rows per micro-batch


def fixed_batch(n: int = 4, width: int = 10, resp: int = 4, seed: int = 0) -> Batch:
    """A left-padded row and a short response among full ones (the same shapes as tests/engines/probes.py)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (n, width), generator=g)
    mask = torch.ones(n, width, dtype=torch.long)
    mask[0, :3] = 0
    rmask = torch.ones(n, resp, dtype=torch.long)
    rmask[1, -2:] = 0
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, -resp:],
            "response_mask": rmask,
            "advantages": torch.randn(n, resp, generator=g),
        }
    )


def pg_loss(outputs: dict[str, torch.Tensor], mb: Batch):
    """A policy-gradient-shaped LossFn: -log p · advantage over the response tokens."""
    return -(outputs["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {"pg": 1.0}


def hf_config(arch: str):
    import transformers

    common = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=64,
        max_position_embeddings=64,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    return transformers.Qwen2Config(**common, tie_word_embeddings=True)  # qkv biases and tied embeddings


def hf_model(arch: str):
    import transformers

    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    return cls(hf_config(arch)).eval()


# ---- what the spawned processes run ---------------------------------------------------------------------------

# (name, arch, tp, pp, what): on a 2-process world the rest is data parallel
TWO_RANKS = [
    ("llama_tp2", "llama", 2, 1),
    ("llama_pp2", "llama", 1, 2),
    ("llama_dp2", "llama", 1, 1),
    ("qwen2_tp2", "qwen2", 2, 1),
    ("qwen2_pp2", "qwen2", 1, 2),
]
ONE_RANK = [("llama_1", "llama", 1, 1), ("qwen2_1", "qwen2", 1, 1)]


def _run_layouts(rank: int, world: int, port: int, runs: list, out_dir: str) -> None:
    join_world(rank, world, port, megatron=True)
    import torch.distributed as dist

    from engines.training.common import OptimConfig
    from engines.training.megatron.engine import MegatronEngine

    try:
        for name, arch, tp, pp in runs:
            model = hf_model(arch)
            engine = MegatronEngine.from_hf_model(
                model, OptimConfig(lr=LR, micro_batch_tokens=MICRO_BATCH_TOKENS), tp=tp, pp=pp
            )
            batch = fixed_batch()
            dp, dp_rank = engine.dp_size, engine.dp_rank
            lp = engine.log_probs(batch, with_entropy=True)
            share = batch.chunk(len(batch) // dp)[dp_rank]  # what a DP protocol hands this rank
            metrics = engine.update([share], pg_loss, lambda mb, e=engine: e.policy_outputs(mb, 1.0, False))
            weights = engine.full_state_dict()
            torch.save(
                {
                    "log_probs": lp["log_probs"],
                    "entropy": lp["entropy"],
                    "metrics": metrics,
                    "weights": weights,
                    "dp": dp,
                },
                Path(out_dir) / f"{name}.{rank}.pt",
            )
            del engine
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_world(out_dir)


def _spawn(world: int, runs: list, out_dir: Path) -> dict[str, list[dict]]:
    import torch.multiprocessing as mp

    mp.spawn(_run_layouts, args=(world, free_port(), runs, str(out_dir)), nprocs=world, join=True)
    return {name: [torch.load(out_dir / f"{name}.{r}.pt") for r in range(world)] for name, *_ in runs}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(2, TWO_RANKS, tmp_path_factory.mktemp("megatron2"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _spawn(1, ONE_RANK, tmp_path_factory.mktemp("megatron1"))


# ---- references in this process ------------------------------------------------------------------------------


def reference(arch: str) -> dict:
    """transformers forward for log-probs; one clipped torch AdamW step on the token-mean pg loss."""
    model = hf_model(arch)
    batch = fixed_batch()
    mask = batch["attention_mask"]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
    ).logits
    resp = response_logits(logits, batch["responses"].shape[1])
    log_probs = token_log_probs(resp, batch["responses"])
    out = {"log_probs": log_probs.detach(), "entropy": entropy_from_logits(resp).detach()}
    token_loss, weight, _ = pg_loss({"log_probs": log_probs}, batch)
    ((token_loss * weight).sum() / batch["response_mask"].sum()).backward()
    params = dict(model.named_parameters())
    out["grads"] = {n: params[n].grad.clone() for n in params}
    out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0).step()
    out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def refs():
    return {arch: reference(arch) for arch in ("llama", "qwen2")}


def assert_weights_match(got: dict, want: dict, grads: dict, initial: dict) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        g = grads.get(name, grads.get("model.embed_tokens.weight"))  # tied lm_head shares the embedding's grad
        err = (got[name] - w).abs()
        assert float((err * (g.abs() > 1e-6)).max()) < 1e-5, name
        assert float(err.max()) <= LR + 1e-5, name
        assert not torch.equal(got[name], initial[name]), f"{name} did not move"


# ---- tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_conversion_round_trip_is_exact(arch, tp, pp):
    sd = hf_model(arch).state_dict()
    cfg = hf_config(arch)
    shards = {(p, t): hf_to_megatron(sd, cfg, t, tp, p, pp) for p in range(pp) for t in range(tp)}
    back = megatron_to_hf(shards, cfg, tp, pp)
    assert set(back) == set(sd)
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_is_interleaved_per_query_group():
    """megatron-core views linear_qkv rows as [group][q heads of the group, k, v] (attention.py, 0.16.1)."""
    cfg, sd = hf_config("llama"), hf_model("llama").state_dict()
    g = megatron_geometry(cfg)
    d, qpg = g.head_dim, g.num_heads // g.num_kv_heads
    q, k, v = (sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    for tp_rank in range(2):
        fused = hf_to_megatron(sd, cfg, tp_rank, 2, 0, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
        group = tp_rank  # 2 kv groups over tp=2: one group per rank
        assert torch.equal(fused[: qpg * d], q[group * qpg * d : (group + 1) * qpg * d])
        assert torch.equal(fused[qpg * d : (qpg + 1) * d], k[group * d : (group + 1) * d])
        assert torch.equal(fused[(qpg + 1) * d :], v[group * d : (group + 1) * d])
        fc1 = hf_to_megatron(sd, cfg, tp_rank, 2, 0, 1)["decoder.layers.0.mlp.linear_fc1.weight"]
        half = g.intermediate_size // 2
        assert torch.equal(fc1[:half], sd["model.layers.0.mlp.gate_proj.weight"][tp_rank * half : (tp_rank + 1) * half])
        assert torch.equal(fc1[half:], sd["model.layers.0.mlp.up_proj.weight"][tp_rank * half : (tp_rank + 1) * half])


@pytest.mark.parametrize(
    "tp,pp,field,fix",
    [
        (3, 1, "num_attention_heads", "choose a tp that divides"),
        (4, 1, "num_key_value_heads", "choose a tp that divides"),
        (1, 3, "num_hidden_layers", "choose a pp that divides 4"),
    ],
)
def test_bad_layout_is_a_clear_error_before_any_collective(tp, pp, field, fix):
    cfg = hf_config("llama")
    with pytest.raises(ValueError, match=field) as info:
        check_megatron_fits(megatron_geometry(cfg), tp, pp)
    assert fix in str(info.value)
    if megatron_available():
        # torch.distributed is not initialised here: an error raised after a collective would be a RuntimeError
        from engines.training.megatron.engine import MegatronEngine

        with pytest.raises(ValueError, match=field):
            MegatronEngine(cfg, hf_model("llama").state_dict(), None, tp=tp, pp=pp)


def test_import_without_megatron_core():
    """`import engines` and `import engines.training.megatron.engine` must not need megatron-core; building the engine does."""
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "import engines, engines.training.megatron.engine\n"
        "assert not engines.training.megatron.engine.megatron_available()\n"
        "from tests.engines.test_megatron import hf_model\n"
        "m = hf_model('llama')\n"
        "try:\n"
        "    engines.training.megatron.engine.MegatronEngine.from_hf_model(m, None)\n"
        "except ImportError as e:\n"
        "    assert 'megatron-core==0.16.1' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)


@needs_megatron
@pytest.mark.parametrize(
    "name,arch",
    [
        ("llama_1", "llama"),
        ("qwen2_1", "qwen2"),
        ("llama_tp2", "llama"),
        ("qwen2_tp2", "qwen2"),
        ("llama_pp2", "llama"),
        ("qwen2_pp2", "qwen2"),
    ],
)
def test_log_probs_equal_transformers(one_rank, two_ranks, refs, name, arch):
    results = (one_rank | two_ranks)[name]
    for r in results:  # every rank, including the first PP stage, returns the last stage's values
        assert torch.allclose(r["log_probs"], refs[arch]["log_probs"], atol=1e-5, rtol=0)
        assert torch.allclose(r["entropy"], refs[arch]["entropy"], atol=1e-5, rtol=0)


@needs_megatron
@pytest.mark.parametrize(
    "name,arch",
    [
        ("llama_1", "llama"),
        ("qwen2_1", "qwen2"),
        ("llama_tp2", "llama"),
        ("qwen2_tp2", "qwen2"),
        ("llama_pp2", "llama"),
        ("qwen2_pp2", "qwen2"),
        ("llama_dp2", "llama"),
    ],
)
def test_update_equals_torch_adamw_step(one_rank, two_ranks, refs, name, arch):
    initial = hf_model(arch).state_dict()
    results = (one_rank | two_ranks)[name]
    for r in results:
        assert abs(r["metrics"]["grad_norm"] - refs[arch]["grad_norm"]) < 1e-5 * refs[arch]["grad_norm"]
        assert r["metrics"]["lr"] == LR
        assert r["metrics"]["pg"] == pytest.approx(1.0)  # the loss's metrics reach every PP stage
        assert_weights_match(r["weights"], refs[arch]["weights"], refs[arch]["grads"], initial)


@needs_megatron
@pytest.mark.parametrize(
    "name,base",
    [
        ("llama_tp2", "llama_1"),
        ("llama_pp2", "llama_1"),
        ("llama_dp2", "llama_1"),
        ("qwen2_tp2", "qwen2_1"),
        ("qwen2_pp2", "qwen2_1"),
    ],
)
def test_parallel_update_equals_tp1_pp1_dp1(one_rank, two_ranks, refs, name, base):
    arch = base.split("_")[0]
    single = one_rank[base][0]
    assert two_ranks["llama_dp2"][0]["dp"] == 2
    for r in two_ranks[name]:
        assert_weights_match(r["weights"], single["weights"], refs[arch]["grads"], hf_model(arch).state_dict())
