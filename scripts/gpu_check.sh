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

check("flowactors NCCL group all_reduce", nccl_group)
check("transformers model on CUDA", engine_cuda)
check("vllm import", vllm_import)
check("megatron-core import", megatron_import)
print(f"\n{'check':<36} {'result':<8} {'time':>6}  detail")
for r in rows:
    print(f"{r[0]:<36} {r[1]:<8} {r[2]:>6}  {r[3]}")
sys.exit(1 if any(r[1] == "FAILED" for r in rows) else 0)
PY
