import pytest

from placement import LlamaSpec, llama_7b, llama_13b, llama_34b, llama_70b, parse_model


@pytest.mark.parametrize(
    "preset, params",
    [
        # Published parameter counts of Llama-2-7B, Llama-2-13B, CodeLlama-34B and Llama-2-70B.
        (llama_7b, 6_738_415_616),
        (llama_13b, 13_015_864_320),
        (llama_34b, 33_743_970_304),
        (llama_70b, 68_976_648_192),
    ],
)
def test_preset_parameter_counts_match_the_released_models(preset, params):
    assert preset().params() == params


def test_value_head_replaces_the_lm_head():
    spec = llama_7b()
    assert spec.params() - spec.params(lm_head=False) == 32000 * 4096 - 4096


def test_toy_counts(toy_spec):
    assert toy_spec.params() == 177_216
    assert toy_spec.matmul_params() == 177_216 - 6_400
    # 2·170,816 matmul FLOPs + causal attention 2·4 layers·32 tokens·64 hidden.
    assert toy_spec.flops_per_token(32) == 341_632 + 16_384
    # 2 (k, v) · 4 layers · 4 kv heads · 16 head dim · 2 bytes.
    assert toy_spec.kv_bytes_per_token == 1024


def test_kv_cache_per_token():
    assert llama_7b().kv_bytes_per_token == 2 * 32 * 4096 * 2  # 512 KiB: full multi-head attention
    assert llama_70b().kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # grouped-query attention, 8 kv heads


def test_parse_model():
    assert parse_model("13B") == llama_13b()
    custom = parse_model("hidden=4096,layers=32,heads=32,ffn=11008")
    assert custom.params() == llama_7b().params()
    assert parse_model("hidden=8192,layers=80,heads=64,ffn=28672,kv_heads=8").kv_heads == 8
    with pytest.raises(ValueError, match="unknown model size"):
        parse_model("12b")
    with pytest.raises(ValueError, match="lacks ffn"):
        parse_model("hidden=64,layers=2,heads=4")
    with pytest.raises(ValueError, match="unknown model dimension 'depth'"):
        parse_model("hidden=64,depth=2,heads=4,ffn=8")


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="hidden=100 must be a multiple of heads=8"):
        LlamaSpec(hidden=100, layers=2, heads=8, ffn=256)
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=8"):
        LlamaSpec(hidden=64, layers=2, heads=8, ffn=256, kv_heads=3)
