"""Ids of the tool calls a model makes, in OpenAI's style."""

from __future__ import annotations

import random
import string

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits, as OpenAI's ids look."""
    return "call_" + "".join(random.choices(_ALNUM, k=24))


def new_mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool call id."""
    return "".join(random.choices(_ALNUM, k=9))
