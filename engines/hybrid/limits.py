"""What a generation engine can take, checked before any collective starts.

A rank that fails a check while its peers enter a collective hangs them (on gloo a crossed collective may instead
return wrong data), so every check here is a pure function of the layout and the model that all ranks evaluate
identically in the `Resharder` constructor. Presets are functions; an engine with other limits builds its own
`GenerationEngineLimits`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.hybrid.layout import HybridLayout
from engines.hybrid.shards import ModelGeometry

__all__ = ["GenerationEngineLimits", "transformers_engine_limits", "vllm_engine_limits"]


@dataclass(frozen=True)
class GenerationEngineLimits:
    """The generation layouts an engine accepts."""

    name: str
    max_tp: int | None = None
    """Largest tensor-parallel size the engine runs, None for no limit beyond the model's heads."""
    supports_pipeline: bool = False
    """Whether the engine runs generation over several pipeline stages (gen_pp > 1)."""
    min_head_dim: int = 1
    """Smallest attention head size its kernels take."""

    def check(self, geometry: ModelGeometry, layout: HybridLayout) -> None:
        """Raise ValueError, naming the fix, when this engine cannot generate under the layout's (p_g, t_g)."""
        t_g, p_g = layout.gen_tp, layout.gen_pp
        if self.max_tp is not None and t_g > self.max_tp:
            raise ValueError(
                f"the {self.name} engine runs at most tensor parallel {self.max_tp}, got gen_tp={t_g}; lower gen_tp"
            )
        if p_g > 1 and not self.supports_pipeline:
            raise ValueError(
                f"the {self.name} engine does not generate over pipeline stages, got gen_pp={p_g}; "
                f"use gen_pp=1 (or an engine that pipelines, e.g. vLLM)"
            )
        if geometry.num_kv_heads % t_g or geometry.num_heads % t_g:
            raise ValueError(
                f"the {self.name} engine splits attention heads evenly: num_attention_heads="
                f"{geometry.num_heads} and num_key_value_heads={geometry.num_kv_heads} must be multiples "
                f"of gen_tp={t_g}"
            )
        if geometry.head_dim < self.min_head_dim:
            raise ValueError(
                f"the {self.name} engine needs head_dim >= {self.min_head_dim}, the model has {geometry.head_dim}"
            )


def transformers_engine_limits() -> GenerationEngineLimits:
    """The transformers decode loop over the hybrid engine's pieces (q/k/v/gate/up colwise, o/down rowwise),
    pipeline stages included (engines.hybrid.actor._PipelineStage)."""
    return GenerationEngineLimits(name="transformers", supports_pipeline=True)


def vllm_engine_limits() -> GenerationEngineLimits:
    """vLLM with external_launcher; head_dim >= 32 was required by the CPU wheel measured (docs/design.md §4)."""
    return GenerationEngineLimits(name="vllm", supports_pipeline=True, min_head_dim=32)
