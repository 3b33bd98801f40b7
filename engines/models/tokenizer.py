"""Tokenizers: Hugging Face `tokenizer.json` everywhere, plus a committed character vocabulary for tiny tasks.

The synthetic tasks (digit sums, short strings) need no subword merges, and a character vocabulary keeps tiny
models tiny (tens of embedding rows). It is a real `tokenizers` WordLevel model with a per-character
pre-tokenizer, saved as `engines/models/assets/char_tokenizer.json`, so it loads through `PreTrainedTokenizerFast`
exactly like any Hub tokenizer and is saved next to checkpoints in Hugging Face format.
"""

from __future__ import annotations

import string
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["CHAR_TOKENIZER_PATH", "char_tokenizer", "load_tokenizer", "build_char_tokenizer_file"]

CHAR_TOKENIZER_PATH = Path(__file__).parent / "assets" / "char_tokenizer.json"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = string.digits + string.ascii_lowercase + " :=+-*/.,?!"


def build_char_tokenizer_file(path: Path = CHAR_TOKENIZER_PATH) -> Path:
    """(Re)create the committed asset; kept for transparency of how it was made."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def char_tokenizer() -> PreTrainedTokenizerFast:
    """The committed character tokenizer, with pad/bos/eos set and left padding (for batched generation)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(CHAR_TOKENIZER_PATH),
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    return tok


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer from a Hugging Face folder; it must define pad and eos tokens (generation needs both)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None:
        raise ValueError(
            f"tokenizer in {path} has no eos token; generation cannot stop without one. Set "
            f"`eos_token` in its tokenizer_config.json"
        )
    if tok.pad_token_id is None:
        raise ValueError(
            f"tokenizer in {path} has no pad token; batched generation needs one. Set `pad_token` in "
            f"its tokenizer_config.json (reusing the eos token is common)"
        )
    tok.padding_side = "left"
    return tok
