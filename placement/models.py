"""Llama-architecture model sizes: parameters, FLOPs and KV-cache bytes (HybridFlow §8.1 workloads).

The paper evaluates Llama models of 7B, 13B, 34B and 70B; the presets are their published shapes (Llama 2 for 7B,
13B and 70B, Code Llama for 34B, all with a 32,000-token vocabulary). Any other shape is a `LlamaSpec` with its own
dimensions, or a `"hidden=4096,layers=32,heads=32,ffn=11008"` string for the command line.

Counting follows the usual dense-transformer arithmetic (Megatron-LM, Narayanan et al. 2021): a matmul with W
weights costs 2·W FLOPs per token; causal attention adds 2·layers·seq·hidden per token on average (QKᵀ and AV over
half the sequence). The embedding lookup is a gather, not a matmul, so it counts for memory only. Critics and
reward models swap the LM head for a one-output value head (`lm_head=False`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LlamaSpec:
    """Dimensions of one Llama-architecture decoder."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means as many as `heads`."""
    vocab: int = 32000
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "ffn", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"LlamaSpec.{field} must be >= 1, got {getattr(self, field)}")
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.hidden % self.heads:
            raise ValueError(f"LlamaSpec.hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"LlamaSpec.kv_heads={self.kv_heads} must divide heads={self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim
        return attention + 3 * self.hidden * self.ffn + 2 * self.hidden  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self, lm_head: bool = True) -> int:
        head = self.vocab * self.hidden if lm_head else self.hidden
        return self.embedding_params + self.layers * self.layer_params + self.hidden + head

    def matmul_params(self, lm_head: bool = True) -> int:
        """Parameters read by matmuls each token: all but the embedding table."""
        return self.params(lm_head) - self.embedding_params

    def flops_per_token(self, seq_tokens: int, lm_head: bool = True) -> float:
        """Forward FLOPs per token of a full pass over sequences of `seq_tokens` (causal attention)."""
        return 2.0 * self.matmul_params(lm_head) + 2.0 * self.layers * seq_tokens * self.hidden

    def decode_flops_per_token(self, context_tokens: float) -> float:
        """Forward FLOPs to decode one token that attends over `context_tokens` (LM head on)."""
        return 2.0 * self.matmul_params() + 4.0 * self.layers * context_tokens * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 keys and values of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def llama_7b() -> LlamaSpec:
    return LlamaSpec(hidden=4096, layers=32, heads=32, ffn=11008, name="7b")


def llama_13b() -> LlamaSpec:
    return LlamaSpec(hidden=5120, layers=40, heads=40, ffn=13824, name="13b")


def llama_34b() -> LlamaSpec:
    return LlamaSpec(hidden=8192, layers=48, heads=64, ffn=22016, kv_heads=8, name="34b")


def llama_70b() -> LlamaSpec:
    return LlamaSpec(hidden=8192, layers=80, heads=64, ffn=28672, kv_heads=8, name="70b")


def divides_heads(spec: LlamaSpec, t: int) -> bool:
    """Whether tensor parallel size `t` can shard the attention heads (key/value heads may be replicated)."""
    return spec.heads % t == 0 and (spec.kv_heads % t == 0 or t % spec.kv_heads == 0)


PRESETS = {"7b": llama_7b, "13b": llama_13b, "34b": llama_34b, "70b": llama_70b}


def parse_model(text: str) -> LlamaSpec:
    """A preset name (`"13b"`) or comma-separated dimensions (`"hidden=4096,layers=32,heads=32,ffn=11008"`)."""
    text = text.strip().lower()
    if text in PRESETS:
        return PRESETS[text]()
    if "=" not in text:
        raise ValueError(
            f"unknown model size {text!r}; use one of {', '.join(PRESETS)} or give dimensions like "
            "'hidden=4096,layers=32,heads=32,ffn=11008'"
        )
    known = {f.name for f in fields(LlamaSpec)} - {"name"}
    dims: dict[str, int] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in known:
            raise ValueError(f"unknown model dimension {key!r} in {text!r}; known: {', '.join(sorted(known))}")
        dims[key] = int(value)
    missing = {"hidden", "layers", "heads", "ffn"} - dims.keys()
    if missing:
        raise ValueError(f"model {text!r} lacks {', '.join(sorted(missing))}")
    return LlamaSpec(**dims, name=text)
