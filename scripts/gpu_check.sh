#!/usr/bin/env bash
# All GPU checks in one call (a lent GPU machine has little time): NCCL groups through flowactors, the engines on
# CUDA, vLLM and megatron-core when installed. Prints a table; exits non-zero if a check that could run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
pip install -q -e ".[test]" >/dev/null 2>&1 || pip install -e ".[test]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no GPU visible"; exit 1; }
python - <<'PY'
import sys, time, traceback
import torch
rows = []

def check(name, fn):
    t0 = time.time()
    try:
        detail = fn()
        rows.append((name, "ok", f"{time.time() - t0:.1f}s", detail or ""))
    except ImportError as e:
        rows.append((name, "skipped", "", f"not installed: {e}"))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rows.append((name, "FAILED", f"{time.time() - t0:.1f}s", repr(e)[:120]))

def nccl_group():
    import torch.distributed as dist
    import flowactors as fa
    from flowactors import ONE_TO_ALL, Worker, endpoint

    class R(Worker):
        @endpoint(protocol=ONE_TO_ALL)
        def reduce(self):
            t = torch.ones(1, device=self.device) * (self.rank + 1)
            dist.all_reduce(t, group=self.process_group)
            return (t.item(), str(self.device), dist.get_backend(self.process_group))

    n = torch.cuda.device_count()
    with fa.Controller.local(n, dashboard=None) as ctl:
        g = fa.ActorGroup(ctl, R, name="r")
        out = g.reduce().result()
    want = n * (n + 1) / 2
    assert all(o[0] == want for o in out), out
    return f"{n} ranks, backend {out[0][2]}, device {out[0][1]}"

def engine_cuda():
    from engines import ModelConfig, build_model, SamplingConfig, HFGenerationEngine, build_tokenizer
    from flowactors import Batch
    cfg = ModelConfig()
    tok = build_tokenizer(cfg)
    m = build_model(cfg, "lm", tok).cuda()
    enc = tok(["sum 12:"], return_tensors="pt")
    b = Batch({"input_ids": enc.input_ids.cuda(), "attention_mask": enc.attention_mask.cuda()})
    ref = m.generate(**{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}, do_sample=False,
                     max_new_tokens=8, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return f"generate ok, {ref.shape}"

def vllm_import():
    import vllm  # noqa: F401
    return vllm.__version__

def megatron_import():
    import megatron.core  # noqa: F401
    return "megatron.core importable"

def megatron_tp1():
    """engines.megatron on real CUDA, no shim: TP=1 log-probs vs transformers, one update, weights back to HF."""
    import os
    import torch.distributed as dist
    import transformers
    from engines.megatron import MegatronEngine
    from engines.ops import position_ids_from_mask, response_logits, token_log_probs
    from engines.training import OptimConfig
    from flowactors import Batch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, vocab_size=64,
                                       max_position_embeddings=64)
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(cfg)
        initial = {k: v.clone() for k, v in hf.state_dict().items()}
        engine = MegatronEngine.from_hf_model(hf, OptimConfig(lr=1e-3, micro_batch_tokens=20))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 60, (4, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        batch = Batch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, -4:],
                       "response_mask": torch.ones(4, 4, dtype=torch.long), "advantages": torch.randn(4, 4, generator=g)})
        lp = engine.log_probs(batch)["log_probs"]
        hf = hf.cuda()
        with torch.no_grad():
            logits = hf(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                        position_ids=position_ids_from_mask(mask).cuda()).logits
        ref = token_log_probs(response_logits(logits, 4), ids[:, -4:].cuda()).cpu()
        err = float((lp - ref).abs().max())
        assert err < 1e-4, f"log-prob error {err}"
        loss = lambda out, mb: (-(out["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {})
        metrics = engine.update([batch], loss, lambda mb: engine.policy_outputs(mb, 1.0, False))
        weights = engine.full_state_dict()
        assert set(weights) == set(initial), "HF names differ after megatron_to_hf"
        assert any(not torch.equal(weights[k], initial[k]) for k in initial), "update moved no weight"
        return f"log-prob err {err:.1e}, grad_norm {metrics['grad_norm']:.3f}, {len(weights)} HF tensors back"
    finally:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

check("flowactors NCCL group all_reduce", nccl_group)
check("transformers model on CUDA", engine_cuda)
check("vllm import", vllm_import)
check("megatron-core import", megatron_import)
check("megatron engine TP=1 on CUDA (no shim)", megatron_tp1)
print(f"\n{'check':<36} {'result':<8} {'time':>6}  detail")
for r in rows:
    print(f"{r[0]:<36} {r[1]:<8} {r[2]:>6}  {r[3]}")
sys.exit(1 if any(r[1] == "FAILED" for r in rows) else 0)
PY
