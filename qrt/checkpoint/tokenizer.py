"""Loading a checkpoint's tokenizer and its end-of-sequence ids."""

import json
import warnings
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(folder: Path):
    """The checkpoint's transformers tokenizer, or None when the folder has none usable
    (token-id input still works then)."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # broken tokenizer files: keep the model usable with token ids
        warnings.warn(f"{folder}: tokenizer files present but unusable ({err}); only token-id input will work")
        return None


def eos_token_ids(folder: Path, hf_config: dict, tokenizer) -> set[int]:
    """Every id that ends generation: generation_config.json, config.json and the tokenizer's."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    generation_config = Path(folder) / "generation_config.json"
    if generation_config.is_file():
        try:
            add(json.loads(generation_config.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError):
            warnings.warn(f"{generation_config}: not valid JSON; ignored")
    add(hf_config.get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids
