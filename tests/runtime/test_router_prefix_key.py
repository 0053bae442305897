"""The router's prefix signal: requests that start alike get one key, others differ, and a
prompt too short to fill a KV block gets none."""

from __future__ import annotations

from kvfleet.runtime.router.prefix_key import prefix_key

SYSTEM_A = "You are a support agent for a bank. " * 12  # ~430 characters
SYSTEM_B = "You are a poet who answers in verse. " * 12
KEY_TOKENS, BLOCK = 64, 16


def chat_key(*messages: tuple[str, str], model: str = "m") -> bytes | None:
    body = {"model": model, "messages": [{"role": r, "content": c} for r, c in messages]}
    return prefix_key(body, True, KEY_TOKENS, BLOCK)


def completion_key(prompt, model: str = "m") -> bytes | None:
    return prefix_key({"model": model, "prompt": prompt}, False, KEY_TOKENS, BLOCK)


def test_a_long_system_prompt_alone_makes_the_key():
    a1 = chat_key(("system", SYSTEM_A), ("user", "What is my balance?"))
    a2 = chat_key(("system", SYSTEM_A), ("user", "Close my account."))
    b = chat_key(("system", SYSTEM_B), ("user", "What is my balance?"))
    assert a1 == a2
    assert a1 != b


def test_after_a_short_system_prompt_the_first_question_makes_the_key():
    short = "Be brief."
    first = ("user", "Tell me about the history of the Roman empire in a few paragraphs, please.")
    turn_1 = chat_key(("system", short), first)
    turn_2 = chat_key(("system", short), first, ("assistant", "It rose. " * 40), ("user", "More."))
    other = chat_key(("system", short), ("user", "Explain how a transistor works, in detail."))
    assert turn_1 == turn_2  # every turn of a conversation returns to its history's replica
    assert turn_1 != other


def test_text_parts_count_and_other_parts_do_not():
    parts = [{"type": "text", "text": SYSTEM_A}, {"type": "image_url", "image_url": {"url": "x"}}]
    body = {"model": "m", "messages": [{"role": "system", "content": parts}]}
    assert prefix_key(body, True, KEY_TOKENS, BLOCK) == chat_key(("system", SYSTEM_A))


def test_completions_key_on_the_first_characters_or_token_ids():
    assert completion_key(SYSTEM_A + "question one") == completion_key(SYSTEM_A + "question two")
    assert completion_key(SYSTEM_A) != completion_key(SYSTEM_B)
    ids = list(range(1000, 1100))
    assert completion_key([*ids, 1, 2]) == completion_key([*ids, 3])
    assert completion_key(ids) != completion_key([7, *ids])
    # A batch is served on one replica: its first prompt decides.
    assert completion_key([SYSTEM_A + "x", "short"]) == completion_key(SYSTEM_A)
    assert completion_key([ids, [1, 2]]) == completion_key(ids)


def test_the_model_is_part_of_the_key():
    assert completion_key(SYSTEM_A, model="a") != completion_key(SYSTEM_A, model="b")


def test_no_key_without_a_full_block_of_prompt():
    assert completion_key("Hello there") is None
    assert completion_key(list(range(BLOCK - 1))) is None
    assert completion_key(list(range(BLOCK))) is not None
    assert chat_key(("user", "hi")) is None
    for body in (None, [], "text", {"prompt": 3}, {"messages": "x"}, {"messages": [1, 2]}):
        assert prefix_key(body, True, KEY_TOKENS, BLOCK) is None
        assert prefix_key(body, False, KEY_TOKENS, BLOCK) is None
