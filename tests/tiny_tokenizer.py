"""A byte-level tokenizer small enough for the tiny checkpoints (259 ids: one per byte, then
<s>, <|im_start|>, <|im_end|>) with a ChatML chat template, for tests that need text in and out."""

import json
from pathlib import Path

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BOS, IM_START, IM_END = 256, 257, 258


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json + tokenizer_config.json into `folder`, and <|im_end|> as the config's EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    chars = _byte_chars()
    assert set(chars) == set(ByteLevel.alphabet())
    vocab = {char: byte for byte, char in enumerate(chars)}  # id = the byte's value
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "chat_template": CHATML, "add_bos_token": False, "model_max_length": 4096,
    }))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update(bos_token_id=BOS, eos_token_id=IM_END)
    config_path.write_text(json.dumps(config, indent=2))


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character map, in byte order: printable bytes stand for themselves, the
    others for characters past 255."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars
