"""A folder's tokenizer is the one AutoTokenizer gives, loaded without AutoTokenizer's imports
where its answer is known: same class, same ids, same chat template and special tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet.runtime.models import tokenizer_loader
from kvfleet.runtime.models.tokenizer_loader import load_folder_tokenizer

TEXT = "Hello, world! Ça va? 数字 123 <|im_end|>  tabs\tand\nlines"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def tokenizer_folder(root: Path, bundled: Path, model_type: str, tokenizer_class: str, **extra):
    """The bundled tokenizer's files with a config.json of `model_type`, and tokenizer_config.json
    naming `tokenizer_class`; `extra` adds keys to tokenizer_config.json."""
    folder = root / f"{model_type}-{tokenizer_class}-{len(extra)}"
    folder.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy2(bundled / name, folder / name)
    tokenizer_config = json.loads((bundled / "tokenizer_config.json").read_text())
    tokenizer_config.update(tokenizer_class=tokenizer_class, **extra)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def assert_same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours(TEXT).input_ids == theirs(TEXT).input_ids
    ids = theirs(TEXT).input_ids
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
        ids, skip_special_tokens=True
    )
    assert ours.chat_template == theirs.chat_template
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True) == (
        theirs.apply_chat_template(MESSAGES, add_generation_prompt=True)
    )


# (model_type, tokenizer_class, extra tokenizer_config keys, whether AutoTokenizer is skipped).
CASES = [
    ("llama", "TokenizersBackend", {}, True),
    ("llama", "PreTrainedTokenizerFast", {}, True),
    ("mistral", "TokenizersBackend", {}, True),
    ("mistral", "PreTrainedTokenizerFast", {}, True),
    # AutoTokenizer decides these itself: qwen2 has a class of its own whatever the folder
    # names, a Hub-declared LlamaTokenizer over a ByteLevel tokenizer.json is overridden, and
    # remote code is never ours to skip.
    ("qwen2", "TokenizersBackend", {}, False),
    ("qwen2", "Qwen2Tokenizer", {}, False),
    ("llama", "LlamaTokenizerFast", {}, False),
    ("llama", "GPT2Tokenizer", {}, False),
    ("llama", "TokenizersBackend", {"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}, False),
]


@pytest.mark.parametrize(("model_type", "tokenizer_class", "extra", "skipped"), CASES)
def test_a_folder_gets_what_autotokenizer_gives(
    tmp_path, bundled_dir, model_type, tokenizer_class, extra, skipped
) -> None:
    """Held to the installed transformers: if a release gives another class for a folder the
    loader takes the generic class for, this fails."""
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path, bundled_dir, model_type, tokenizer_class, **extra)
    assert tokenizer_loader._autotokenizer_picks_generic(folder) is skipped
    if "auto_map" in extra:
        return  # AutoTokenizer would ask to run the folder's code; the loader leaves it to it
    assert_same_tokenizer(load_folder_tokenizer(folder), AutoTokenizer.from_pretrained(folder))


def test_the_bundled_and_tiny_models_skip_autotokenizer(bundled_dir, tiny_llama_dir) -> None:
    """The folders the engine serves most take the short path, and tiny Qwen2 the long one."""
    from transformers import AutoTokenizer

    for folder in (bundled_dir, tiny_llama_dir):
        assert tokenizer_loader._autotokenizer_picks_generic(folder)
        assert_same_tokenizer(load_folder_tokenizer(folder), AutoTokenizer.from_pretrained(folder))


def test_loading_a_served_tokenizer_imports_no_torch(bundled_dir) -> None:
    """A server process loads its tokenizer while its engine core loads the weights: without
    torch, that takes a third of the time on a 2-core host."""
    code = (
        "import sys\n"
        "from kvfleet.runtime.models.tokenizer_loader import load_tokenizer\n"
        f"tok = load_tokenizer({str(bundled_dir)!r})\n"
        "assert tok('hi').input_ids, 'no ids'\n"
        "tok = load_tokenizer('random:tiny')\n"
        "heavy = sorted(m for m in ('torch', 'transformers.models.auto') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_an_unreadable_config_goes_through_autotokenizer(tmp_path, bundled_dir) -> None:
    folder = tokenizer_folder(tmp_path, bundled_dir, "llama", "TokenizersBackend")
    (folder / "config.json").write_text("{not json")
    assert not tokenizer_loader._autotokenizer_picks_generic(folder)
    (folder / "config.json").unlink()
    assert not tokenizer_loader._autotokenizer_picks_generic(folder)
