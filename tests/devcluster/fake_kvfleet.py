"""A stand-in for `python -m kvfleet.runtime.cli` in kubelet simulator tests: fast, no model.

The simulator runs `<python> -m kvfleet.runtime.cli ARGS`; `fake_python(folder)` writes a
script that runs this file instead, so a test sees exactly what each container was given.

- `download ...`: records its arguments and environment in $HF_HOME/download.json, takes
  $FAKE_DOWNLOAD_SECONDS (default 0), then exits with $FAKE_DOWNLOAD_EXIT (default 0),
  printing $FAKE_DOWNLOAD_ERROR first when it fails.
- `serve ... --host H --port P`: records the same in $HF_HOME/serve.json and answers GET
  /health on H:P: 200 once $HF_HOME/download.json exists (the init container's files reached
  this container's volume), else 503. Exits 0 on SIGTERM.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import time
from pathlib import Path


def fake_python(folder: Path) -> str:
    """An executable that the simulator can use as its `python`: it runs this fake."""
    script = folder / "fake-python"
    script.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {Path(__file__)} "$@"\n')
    script.chmod(0o755)
    return str(script)


def _record(name: str, args: list[str]) -> Path:
    home = Path(os.environ["HF_HOME"])
    if str(home).startswith("/var/cache/"):  # the pod's path, not translated: never write there
        sys.exit(f"fake kvfleet: HF_HOME {home} is the container's path, not a host folder")
    home.mkdir(parents=True, exist_ok=True)
    (home / name).write_text(json.dumps({"args": args, "env": dict(os.environ)}))
    return home


def main(args: list[str]) -> int:
    if args[0] == "download":
        time.sleep(float(os.environ.get("FAKE_DOWNLOAD_SECONDS", "0")))
        _record("download.json", args)
        code = int(os.environ.get("FAKE_DOWNLOAD_EXIT", "0"))
        if code:
            print("fetching files...", flush=True)
            print(os.environ.get("FAKE_DOWNLOAD_ERROR", "download failed"), file=sys.stderr)
        return code
    if args[0] == "serve":
        home = _record("serve.json", args)
        host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.path == "/health" and (home / "download.json").exists()
                self.send_response(200 if ok else 503)
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        server = http.server.HTTPServer((host, port), Health)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        server.serve_forever()
    print(f"fake kvfleet: unknown command {args!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
