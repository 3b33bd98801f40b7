"""TP and FSDP2 against a single-process reference, on real process groups of a LocalCluster."""

import pytest
import torch

import flowactors as fa
from engines import ModelConfig
from engines.protocols import plan_minibatches
from engines.specs import UpdateSpec
from flowactors import Layout
from tests.engines.probes import ParallelProbe, fixed_batch

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def reference(controller4):
    g = fa.ActorGroup(controller4, ParallelProbe, name="ref1", slots=controller4.slots[:1], args=(CFG,))
    yield g
    g.close()


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(dp=2, tp=2)], ids=["tp2", "dp2xtp2"])
def test_tensor_parallel_logits_and_grads_equal_tp1(controller4, reference, layout):
    batch = fixed_batch()
    ref_logits, ref_grads = reference.logits_and_grads(batch).result()[0]
    g = fa.ActorGroup(
        controller4,
        ParallelProbe,
        name=f"tp_{layout.dp}x{layout.tp}",
        slots=controller4.slots[: layout.world_size],
        layout=layout,
        args=(CFG,),
    )
    try:
        for logits, grads in g.logits_and_grads(batch).result():
            assert torch.allclose(logits, ref_logits, atol=1e-5)
            for name, grad in ref_grads.items():
                assert torch.allclose(grads[name], grad, atol=1e-5), name
    finally:
        g.close()


def test_fsdp2_dp2_update_equals_single_process_update(controller4, reference):
    from engines import build_model

    batch, spec = fixed_batch(n=8, seed=1), UpdateSpec(mini_batch_samples=4, epochs=2, shuffle_seed=5)
    initial = build_model(CFG, "lm").state_dict()
    ref = reference.update_then_weights([plan_minibatches(batch, 1, spec)[0]]).result()[0]
    assert any(not torch.allclose(ref[n], initial[n]) for n in ref)  # four optimizer steps moved the weights
    g = fa.ActorGroup(
        controller4, ParallelProbe, name="fsdp2", slots=controller4.slots[:2], layout=Layout(dp=2), args=(CFG,)
    )
    try:
        for weights in g.update_then_weights(plan_minibatches(batch, 2, spec)).result():
            for name, w in ref.items():
                assert torch.allclose(weights[name], w, atol=2e-6), name
    finally:
        g.close()
