"""Models in Hugging Face format: build tiny ones from a config, load and save checkpoint folders.

Every model is a transformers model (Llama or Qwen2 architecture), so any Llama/Qwen-style checkpoint folder
(config.json + safetensors + tokenizer.json) loads, and what we save loads in transformers and vLLM. Heads:
`lm` (causal LM: actor, reference), `value` (a scalar per token: critics), `score` (a scalar per sequence, read
at the last non-pad token: reward and cost models). Value and score models built from a causal-LM checkpoint keep
its backbone and start their head from zero, the usual initialisation of critics from the SFT model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from engines.models.tokenizer import char_tokenizer, load_tokenizer

__all__ = [
    "ModelConfig",
    "build_model",
    "build_tokenizer",
    "same_vocabulary",
    "save_pretrained",
    "check_model_dir",
    "freeze_lower_layers",
    "head_dim",
    "SUPPORTED_ARCHITECTURES",
]

Head = Literal["lm", "value", "score"]
_ARCH = {
    "llama": (
        "LlamaConfig",
        {"lm": "LlamaForCausalLM", "value": "LlamaForTokenClassification", "score": "LlamaForSequenceClassification"},
    ),
    "qwen2": (
        "Qwen2Config",
        {"lm": "Qwen2ForCausalLM", "value": "Qwen2ForTokenClassification", "score": "Qwen2ForSequenceClassification"},
    ),
}
SUPPORTED_ARCHITECTURES = sorted({cls for _, heads in _ARCH.values() for cls in heads.values()})
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """Where a model comes from. With `path`, a Hugging Face folder; without, a random model of these sizes."""

    path: str | None = None
    """Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files). None: build from sizes."""
    tokenizer: str | None = None
    """Tokenizer folder; None: the one in `path`, or the committed character tokenizer when building."""
    arch: str = "llama"
    """Architecture when building from sizes: llama or qwen2."""
    hidden_size: int = 64
    """Width of a built model (the residual stream)."""
    num_layers: int = 2
    """Decoder layers of a built model."""
    num_heads: int = 4
    """Attention (query) heads of a built model; must divide hidden_size."""
    num_kv_heads: int = 2
    """Key/value heads of a built model (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 128
    """Width of a built model's MLP."""
    max_position_embeddings: int = 256
    """Longest sequence (prompt + response) a built model accepts."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    seed: int = 0
    """Initialisation seed when building (identical on every rank)."""
    engine: str = "torch"
    """Training engine, by name in engines.registry: torch (FSDP2 / DTensor TP) or megatron (megatron-core GPTModel
    with TP/PP/DP); both build every head (lm, value, score)."""
    pad_vocab_to: int = 1
    """Round the vocabulary of a built model up to a multiple of this (Megatron's make-vocab-size-divisible-by),
    so a vocab-parallel split (the 3D-HybridEngine's training layout) divides it."""
    pack_sequences: bool = False
    """Forward and backward passes over packed rows instead of padded ones (engines.training.packing; torch
    engine): rows of different lengths laid end to end, each attending only to itself, micro-batches filled by
    valid tokens."""
    num_labels: int = 1
    """Outputs of a value or score head (one per constraint for a shared cost critic); 1: a scalar head."""

    def __post_init__(self) -> None:
        if self.num_labels < 1:
            raise ValueError(f"ModelConfig.num_labels must be >= 1, got {self.num_labels}")
        if self.arch not in _ARCH:
            raise ValueError(f"ModelConfig.arch must be one of {sorted(_ARCH)}, got {self.arch!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.path is None:
            for name in (
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "intermediate_size",
                "max_position_embeddings",
            ):
                if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                    raise ValueError(f"ModelConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
                )
            if self.pad_vocab_to < 1:
                raise ValueError(f"ModelConfig.pad_vocab_to must be >= 1, got {self.pad_vocab_to}")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"ModelConfig.num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
                )
            head_dim = self.hidden_size // self.num_heads
            if head_dim % 2:  # rotary embeddings rotate pairs of dimensions
                raise ValueError(
                    f"ModelConfig: head size hidden_size / num_heads = {self.hidden_size} / "
                    f"{self.num_heads} = {head_dim} must be even (rotary embeddings); change either"
                )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """Whether token ids mean the same text under both tokenizers (vocabulary and special tokens)."""
    specials = ("pad_token_id", "eos_token_id", "bos_token_id")
    return a.get_vocab() == b.get_vocab() and all(getattr(a, k) == getattr(b, k) for k in specials)


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    if cfg.path:
        return load_tokenizer(cfg.path)
    return char_tokenizer()


def check_model_dir(path: str | Path) -> dict:
    """The folder's config as a dict, or a clear error for a missing or unsupported checkpoint."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model folder {p} does not exist; give a Hugging Face checkpoint folder")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{p} has no config.json; it is not a Hugging Face checkpoint folder "
            f"(save one with engines.save_pretrained or transformers' save_pretrained)"
        )
    if not (list(p.glob("*.safetensors")) or list(p.glob("*.bin"))):
        raise FileNotFoundError(f"{p} has config.json but no weights (*.safetensors); the checkpoint is incomplete")
    cfg = json.loads(cfg_file.read_text())
    model_type = cfg.get("model_type")
    if model_type not in _ARCH:
        raise ValueError(
            f"{p} holds a {model_type!r} model ({cfg.get('architectures')}); supported model types: "
            f"{sorted(_ARCH)} (Llama- and Qwen2-style decoders)"
        )
    return cfg


def head_dim(cfg: ModelConfig) -> int:
    """The attention head size of the model `cfg` builds or loads (its folder's config.json when it has a path)."""
    if cfg.path is None:
        return cfg.hidden_size // cfg.num_heads
    hf = check_model_dir(cfg.path)
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def build_model(
    cfg: ModelConfig, head: Head = "lm", tokenizer: PreTrainedTokenizerBase | None = None
) -> torch.nn.Module:
    """A transformers model with the given head, on CPU, in `cfg.dtype`. Value and score heads have no dropout
    (as verl's critics): a critic's values are then a function of its weights alone, on every engine."""
    import transformers

    transformers.logging.set_verbosity_error()  # "newly initialized head" notices are expected for critics
    transformers.logging.disable_progress_bar()  # a bar per model per rank; the controller reports loading instead
    tokenizer = tokenizer or build_tokenizer(cfg)
    if cfg.path is not None:
        hf_cfg = check_model_dir(cfg.path)
        arch = hf_cfg["model_type"]
        cls = getattr(transformers, _ARCH[arch][1][head])
        kwargs = {}
        if head != "lm":  # set on the config: a config that lacks the field would pass it to the model's __init__
            config = transformers.AutoConfig.from_pretrained(cfg.path, num_labels=cfg.num_labels)
            config.classifier_dropout = 0.0
            kwargs["config"] = config
        model = cls.from_pretrained(cfg.path, dtype=cfg.torch_dtype, **kwargs)
    else:
        config_cls, heads = _ARCH[cfg.arch]
        vocab = -(-len(tokenizer) // cfg.pad_vocab_to) * cfg.pad_vocab_to
        hf_config = getattr(transformers, config_cls)(
            vocab_size=vocab,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
            num_labels=1 if head == "lm" else cfg.num_labels,
            classifier_dropout=0.0,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = getattr(transformers, heads[head])(hf_config).to(cfg.torch_dtype)
    if head != "lm":
        model.config.pad_token_id = tokenizer.pad_token_id
        for name in ("score",):
            mod = getattr(model, name, None)
            if cfg.path is not None and mod is not None and "score.weight" not in _saved_keys(cfg.path):
                torch.nn.init.zeros_(mod.weight)
    return model


def freeze_lower_layers(model: torch.nn.Module, trainable_layers: int) -> None:
    """Leave only the top `trainable_layers` decoder layers, the final norm and the head trainable: the embeddings
    (and a head tied to them) and the layers below are frozen, so backward stops at the lowest trainable layer."""
    base = getattr(model, model.base_model_prefix)
    layers = base.layers
    if not 0 < trainable_layers <= len(layers):
        raise ValueError(
            f"trainable_layers={trainable_layers} but the model has {len(layers)} decoder layers; give "
            f"1..{len(layers)}, or 0 to train every parameter"
        )
    base.embed_tokens.requires_grad_(False)
    for layer in layers[: len(layers) - trainable_layers]:
        layer.requires_grad_(False)


def _saved_keys(path: str) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            keys.update(sf.keys())
    return keys


def save_pretrained(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    path: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a Hugging Face folder (config, safetensors, tokenizer) that transformers and vLLM load. The caller
    decides who writes (a group's rank 0): transformers would write only on the torch.distributed world's rank 0,
    which a group placed on later slots (a plan's pool, the rollout replicas) does not hold, and would then write
    nothing but the tokenizer, silently."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "should_save_on_this_rank"):
        model.should_save_on_this_rank = lambda is_main_process: is_main_process  # this instance only
    model.save_pretrained(str(p), state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(p))
    return p


def linear_layer_names(cfg: ModelConfig) -> set[str]:
    """The last name of every linear layer of the model `cfg` builds (q_proj, ..., lm_head), from its architecture
    alone: built on the meta device, no weights read or allocated (what LoRA's targets are checked against before
    any worker starts)."""
    import transformers

    with torch.device("meta"):
        if cfg.path is not None:
            config = transformers.AutoConfig.from_pretrained(cfg.path)
            model = transformers.AutoModelForCausalLM.from_config(config)
        else:
            model = build_model(cfg, "lm")
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
