"""How many places of a verify call on the bf16 MTP test model (latent attention, experts) differ
from the decode steps feeding the same tokens, over N prompts: the property that
tests/test_speculative_mtp.py checks on six.

    python -m bench.probes.mtp_verify_trials 60

Measured on an AMD EPYC (AVX2): 1 of 240 places differed while latent attention ran SDPA in
decode steps and checks, 0 of 240 with its per-query attention (qrt/runtime/models/mla.py).
"""
import argparse
import pathlib
import sys
import tempfile

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[2] / "tests")]
from helpers.checkpoints.mtp import make_mtp_checkpoint, train_mtp_layer  # noqa: E402
from helpers.speculation import verify_beside_decode  # noqa: E402

from qrt import runtime  # noqa: E402

K, SLOTS, MAX_SEQ_LEN, VOCAB = 3, 3, 128, 300  # as tests/test_speculative_mtp.py


def unequal_places(prompts: int) -> list[tuple[int, int, int]]:
    """(prompt, place, prompt length) of each verify place whose logits are not the decode step's."""
    folder = pathlib.Path(tempfile.mkdtemp())
    make_mtp_checkpoint(folder, dtype=torch.bfloat16)
    train_mtp_layer(folder)
    model = runtime.compile_model(folder, progress=False, max_seq_len=MAX_SEQ_LEN, max_batch_size=SLOTS,
                                  speculative={"method": "mtp", "num_speculative_tokens": K}, cache=False)
    unequal = []
    for trial in range(prompts):
        generator = torch.Generator().manual_seed(trial)
        prompt = torch.randint(0, VOCAB, (5 + 17 * (trial % 6),), generator=generator).tolist()
        verified, decoded, _, _ = verify_beside_decode(model, prompt, trial % SLOTS, K)
        unequal += [(trial, place, len(prompt)) for place in range(K + 1)
                    if not torch.equal(verified[place], decoded[place])]
    return unequal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=int, nargs="?", default=60)
    prompts = parser.parse_args().prompts
    unequal = unequal_places(prompts)
    print(f"unequal places (prompt, place, prompt length): {unequal}: {len(unequal)} of {prompts * (K + 1)}")


if __name__ == "__main__":
    main()
