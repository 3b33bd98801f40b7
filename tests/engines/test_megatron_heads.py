"""The megatron engine's scalar heads (critic values, reward scores) against transformers, on spawned gloo processes.

As in tests/engines/test_megatron.py: one spawn of two CPU processes (with the CUDA shim) runs each layout in turn,
the references run in the pytest process. Values and scores must equal the transformers *ForTokenClassification /
*ForSequenceClassification model built with the same weights; one critic step with a squared value loss must give
TrainEngine's updated weights. The batch has a left-padded prompt and a right-padded response, with pad tokens in
the padding, so the score's "last non-pad token" differs from the last column.

Adam's eps is 1e-4 (as in tests/engines/test_megatron_roles.py): with 1e-8, elements whose gradient is within float
noise of eps take noise-sized steps in any implementation. The token classifier's dropout is set to 0 in the
reference: the megatron value head has none (as verl's critics).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.training.common import OptimConfig
from engines.training.megatron.convert import hf_to_megatron, megatron_to_hf
from engines.training.torch_native import TrainEngine
from flowactors import Batch
from tests.engines.probes import squared_value_loss
from tests.engines.test_megatron import needs_megatron
from tests.ranks import free_port, join_world, leave_world

PAD = 0
OPTIM = OptimConfig(lr=1e-2, eps=1e-4, micro_batch_tokens=20)  # 10-token rows: 2 rows per micro-batch


def hf_model(arch: str, head: str):
    import transformers

    config_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    config = config_cls(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=64,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=PAD,
        classifier_dropout=0.0,
        tie_word_embeddings=arch == "qwen2",
    )
    kind = "ForTokenClassification" if head == "value" else "ForSequenceClassification"
    torch.manual_seed(0)
    model = getattr(transformers, f"{'Llama' if arch == 'llama' else 'Qwen2'}{kind}")(config)
    with torch.no_grad():  # the head starts at zero in build_model; random here so values are not trivially 0
        model.score.weight.normal_(0, 0.5)
    return model.eval()


def head_batch(n: int = 4, width: int = 10, resp: int = 4) -> Batch:
    """Row 0: prompt left-padded by 3; row 1: response right-padded by 2 (pad tokens, masked)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (n, width), generator=g)
    mask = torch.ones(n, width, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    ids[mask == 0] = PAD
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, -resp:],
            "response_mask": mask[:, -resp:].clone(),
            "returns": torch.randn(n, resp, generator=g),
        }
    )


# ---- what the spawned processes run ---------------------------------------------------------------------------

# (name, arch, head, tp, pp): on a 2-process world the rest is data parallel
RUNS = [
    ("value_llama_tp2", "llama", "value", 2, 1),
    ("value_qwen2_pp2", "qwen2", "value", 1, 2),
    ("value_llama_dp2", "llama", "value", 1, 1),
    ("score_qwen2_tp2", "qwen2", "score", 2, 1),
    ("score_llama_pp2", "llama", "score", 1, 2),
]


def _run_layouts(rank: int, world: int, port: int, out_dir: str) -> None:
    join_world(rank, world, port, megatron=True)
    import torch.distributed as dist

    from engines.training.megatron.engine import MegatronEngine

    try:
        for name, arch, head, tp, pp in RUNS:
            trainable = head == "value"
            engine = MegatronEngine.from_hf_model(hf_model(arch, head), OPTIM, tp=tp, pp=pp, trainable=trainable)
            batch = head_batch()
            out = {}
            if head == "value":
                out["values"] = engine.values(batch)
                dp, dp_rank = engine.dp_size, engine.dp_rank
                share = batch.chunk(len(batch) // dp)[dp_rank]
                out["metrics"] = engine.update([share], squared_value_loss, engine.value_outputs)
            else:
                out["scores"] = engine.scores(batch)
            out["weights"] = engine.full_state_dict()
            torch.save(out, Path(out_dir) / f"{name}.{rank}.pt")
            del engine
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_world(out_dir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("megatron_heads")
    mp.spawn(_run_layouts, args=(2, free_port(), str(out_dir)), nprocs=2, join=True)
    return {name: [torch.load(out_dir / f"{name}.{r}.pt") for r in range(2)] for name, *_ in RUNS}


# ---- references in this process ------------------------------------------------------------------------------


def reference(arch: str, head: str) -> dict:
    model = hf_model(arch, head)
    batch = head_batch()
    engine = TrainEngine(model, OPTIM)
    if head == "score":
        return {"scores": engine.scores(batch), "weights": engine.full_state_dict()}
    out = {"values": engine.values(batch)}
    out["metrics"] = engine.update([batch], squared_value_loss, engine.value_outputs)
    out["weights"] = engine.full_state_dict()
    return out


# ---- tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("head", ["value", "score"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_scalar_head_conversion_round_trip_is_exact(arch, head, tp, pp):
    model = hf_model(arch, head)
    sd, cfg = model.state_dict(), model.config
    shards = {(p, t): hf_to_megatron(sd, cfg, t, tp, p, pp, head) for p in range(pp) for t in range(tp)}
    assert torch.equal(shards[(pp - 1, tp - 1)]["output_layer.weight"], sd["score.weight"])  # whole on every TP rank
    back = megatron_to_hf(shards, cfg, tp, pp, head)
    assert set(back) == set(sd)  # score.bias for the token classifier, no lm_head even when tied
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


def test_score_with_several_outputs_is_refused():
    model = hf_model("llama", "score")
    sd = {**model.state_dict(), "score.weight": torch.zeros(2, 64)}
    with pytest.raises(ValueError, match="scalar heads only"):
        hf_to_megatron(sd, model.config, 0, 1, 0, 1, "score")


def test_reference_scores_pool_the_last_non_pad_token():
    """Guards the batch: the padded rows' scores are not read at the last column."""
    model, batch = hf_model("llama", "score"), head_batch()
    with torch.no_grad():
        per_token = model.score(
            model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        )
    scores = TrainEngine(model, None, trainable=False).scores(batch)
    assert torch.allclose(scores[1], per_token[1, -3, 0], atol=1e-5)
    assert not torch.allclose(scores[1], per_token[1, -1, 0], atol=1e-3)


@needs_megatron
@pytest.mark.parametrize("name", ["value_llama_tp2", "value_qwen2_pp2", "value_llama_dp2"])
def test_values_and_critic_update_equal_train_engine(two_ranks, name):
    arch = name.split("_")[1]
    ref = reference(arch, "value")
    mask = head_batch()["response_mask"].bool()
    initial = hf_model(arch, "value").state_dict()
    for r in two_ranks[name]:  # every rank, every PP stage, gets the last stage's values and metrics
        err = (r["values"] - ref["values"]).abs()[mask]  # masked: right-padded queries differ in position ids
        assert float(err.max()) < 1e-5
        assert r["metrics"]["vf"] == pytest.approx(1.0)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert set(r["weights"]) == set(ref["weights"])
        for k, w in ref["weights"].items():
            torch.testing.assert_close(r["weights"][k], w, atol=2e-5, rtol=0, msg=k)
            assert not torch.equal(r["weights"][k], initial[k]), f"{k} did not move"


@needs_megatron
@pytest.mark.parametrize("name", ["score_qwen2_tp2", "score_llama_pp2"])
def test_scores_equal_transformers(two_ranks, name):
    ref = reference(name.split("_")[1], "score")
    for r in two_ranks[name]:
        assert r["scores"].shape == (4,)
        torch.testing.assert_close(r["scores"], ref["scores"], atol=1e-5, rtol=0)
        assert set(r["weights"]) == set(ref["weights"])
