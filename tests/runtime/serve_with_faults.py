"""`kvfleet serve` with faults injected where only a test can reach, each set off by a marker in
the request. Run as a script with serve's arguments; used by test_server_hardening.

- FAULT_TOKEN in a prompt: the forward pass of any batch holding it fails. No single request
  can be blamed for that (it is the model failing), so the engine stops.
- SAMPLER_FAULT as a stop string: sampling that request fails (the engine fails it alone).
- ENCODE_FAULT in a prompt: tokenizing it raises an unexpected exception in the handler.
- SLOW_ENCODE in a prompt: tokenizing it takes SLOW_ENCODE_S seconds.

The faults are installed when this file is imported, which happens twice: as the server's
`__main__`, and as `__mp_main__` in the engine core's process, which multiprocessing's spawn
method starts by running the parent's main file (the model runner and sampler live there).
"""

from __future__ import annotations

import sys
import time

from kvfleet.runtime.cli import main
from kvfleet.runtime.engine import input_processor, model_runner, sampler

FAULT_TOKEN = 31337
SAMPLER_FAULT = "\x00sampler fault\x00"
ENCODE_FAULT = "\x00encode fault\x00"
SLOW_ENCODE = "\x00slow encode\x00"
SLOW_ENCODE_S = 3.0


def _install() -> None:
    execute = model_runner.ModelRunner.execute
    sample = sampler.Sampler.__call__
    encode = input_processor.InputProcessor.encode

    def failing_execute(self, batch, previous=None):  # type: ignore[no-untyped-def]
        if any(FAULT_TOKEN in r.prompt_token_ids for r in batch.requests):
            raise RuntimeError("injected forward-pass fault")
        return execute(self, batch, previous)

    def failing_sample(self, logits, requests, argmax=None):  # type: ignore[no-untyped-def]
        if any(SAMPLER_FAULT in r.params.stop for r in requests):
            raise RuntimeError("injected sampler fault")
        return sample(self, logits, requests, argmax)

    def failing_encode(self, prompt, add_special_tokens=True):  # type: ignore[no-untyped-def]
        if ENCODE_FAULT in prompt:
            raise KeyError("injected encode fault")
        if SLOW_ENCODE in prompt:
            time.sleep(SLOW_ENCODE_S)
        return encode(self, prompt, add_special_tokens)

    model_runner.ModelRunner.execute = failing_execute  # type: ignore[method-assign]
    sampler.Sampler.__call__ = failing_sample  # type: ignore[method-assign]
    input_processor.InputProcessor.encode = failing_encode  # type: ignore[method-assign]


if __name__ in ("__main__", "__mp_main__"):
    _install()
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
