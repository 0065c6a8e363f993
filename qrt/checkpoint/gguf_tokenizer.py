"""The tokenizer of a GGUF file: built from the file's metadata by transformers the first time,
then kept in qrt's cache.

`AutoTokenizer.from_pretrained(gguf_file=)` parses the whole file's metadata with gguf-py to
build a config, only to pick the tokenizer class: about 5 s and a few hundred MiB on a 49k-token
vocabulary. qrt already holds the config (gguf_config.py), so it picks the class from it as
AutoTokenizer would and lets that class read the tokenizer fields (0.3 s); where AutoTokenizer
would look further (a tokenizer_config.json beside the file, a config naming its tokenizer
class), AutoTokenizer builds it. Loading the saved tokenizer takes a fraction of a second. An
entry is keyed by the file's resolved path, size and modification time and by transformers'
version, so a changed file or library builds it again.
"""

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from qrt.cache_dir import cache_root

_MARKER = ".complete"


def read_gguf_tokenizer(path: Path, config=None):
    """The tokenizer the file's metadata describes, or None where it has none usable (token-id
    input still works then, as for a folder without tokenizer files). config: the file's
    transformers config, which names the tokenizer class."""
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    entry = _entry(path)
    if (entry / _MARKER).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except (OSError, ValueError):
            pass  # a damaged entry: built again below
    try:
        tokenizer_class = _tokenizer_class(path, config) or AutoTokenizer
        tokenizer = tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as err:
        warnings.warn(f"{path}: no usable tokenizer in its metadata ({err}); only token-id input will work")
        return None
    _save(tokenizer, entry)
    return tokenizer


def _tokenizer_class(path: Path, config):
    """The class AutoTokenizer picks for a GGUF with this config, where that is plain to see: no
    tokenizer_config.json beside the file and no tokenizer class named in the config; then the
    class registered for the config's type, or the generic tokenizers backend. None otherwise."""
    if config is None or getattr(config, "tokenizer_class", None) or (path.parent / "tokenizer_config.json").exists():
        return None
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING, TokenizersBackend

    chosen = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    # Mistral's own backend decides between formats by the files it finds: AutoTokenizer's call.
    return None if chosen is None or chosen.__name__ == "MistralCommonBackend" else chosen


def _entry(path: Path) -> Path:
    import transformers

    stat = path.stat()
    identity = json.dumps([str(path), stat.st_size, stat.st_mtime_ns, transformers.__version__])
    return cache_root() / "gguf-tokenizers" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def _save(tokenizer, entry: Path) -> None:
    """Write the entry beside its final place and rename it there, so a reader never sees half of
    one; a cache that cannot be written only costs the next load its time."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / _MARKER).touch()
        shutil.rmtree(entry, ignore_errors=True)  # a damaged entry
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
