"""Models from the Hugging Face Hub: `--model org/name [--revision R]` becomes a folder in the
Hugging Face cache (`$HF_HOME/hub`), downloaded once with `huggingface_hub` and read from disk
afterwards (with `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached, the cache alone).

Only what the runtime reads is fetched: the config, the tokenizer and chat-template files, and
the safetensors weights — of a sharded model only the shards its index names (repos such as
Mistral's also carry a consolidated copy of the same weights). Downloads resume where they
stopped. Every failure becomes a ModelLoadError naming the model and what to do.

The environment (HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN) is read at each
call rather than when huggingface_hub was imported.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.errors import ModelLoadError

from kvfleet import contract

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DEFAULT_ENDPOINT = "https://huggingface.co"
INDEX = "model.safetensors.index.json"
# Besides the weights: what config, tokenizer and chat template loading may read.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "adapter_config.json",  # a LoRA adapter's repo (PEFT): no config.json, this instead
)
PROGRESS_EVERY_S = 10.0  # log lines while downloading without a terminal


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a Hub repo id (`org/name`) rather than a local path; a folder
    of that relative name that exists wins, as in transformers."""
    return bool(HUB_ID.match(model)) and not Path(model).exists()


def hub_cache() -> Path:
    """Where huggingface_hub keeps repos: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download_model(repo_id: str, revision: str | None = None, token: str | None = None) -> Path:
    """The folder of `repo_id` at `revision` (default main) in the Hugging Face cache, fetching
    what is missing unless offline."""
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    token = token or os.environ.get("HF_TOKEN") or None
    # huggingface_hub's HTTP client logs every request at INFO; our own lines say more.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))
    if offline():
        return _from_cache(repo_id, revision, where, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        wanted = _wanted_files(sizes, lambda: _read_index(api, repo_id, info.sha, endpoint, token))
    except HfHubHTTPError as exc:
        raise _hub_error(exc, repo_id, where, endpoint) from None
    except _unreachable() as exc:  # the Hub cannot be reached: what the cache holds may do
        log.warning("cannot reach %s (%s); looking for %s in the cache", endpoint, exc, where)
        return _from_cache(repo_id, revision, where, f"{endpoint} cannot be reached ({exc})")
    _check_room(repo_id, {f: sizes[f] for f in wanted})
    from huggingface_hub import snapshot_download

    log.info(
        "model %s: %d files, %.2f GB, from %s (commit %s)",
        where,
        len(wanted),
        sum(sizes[f] for f in wanted) / 1e9,
        endpoint,
        (info.sha or "")[:12],
    )
    try:
        with _progress(repo_id, sum(sizes[f] for f in wanted)):
            folder = snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=sorted(wanted),
                cache_dir=hub_cache(),
                endpoint=endpoint,
                token=token,
            )
    except HfHubHTTPError as exc:
        raise _hub_error(exc, repo_id, where, endpoint) from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ModelLoadError(_no_room(repo_id, sum(sizes[f] for f in wanted))) from None
        raise ModelLoadError(f"model: downloading {where} from {endpoint} failed: {exc}") from None
    return _complete(Path(folder), where)


def _unreachable() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "no answer from the Hub": OSError, and the connect and timeout
    errors of the HTTP client huggingface_hub uses (httpx, or its fork httpx2)."""
    import importlib

    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            client = importlib.import_module(name)
        except ImportError:
            continue
        errors += [client.ConnectError, client.TimeoutException]
    return tuple(errors)


def _wanted_files(sizes: dict[str, int], read_index: Callable[[], dict[str, Any]]) -> set[str]:
    """The files to fetch from a repo listing (file -> size)."""
    small = {f for f in sizes if f in SMALL_FILES}
    if INDEX in sizes:
        shards = set(read_index()["weight_map"].values())
        missing = shards - set(sizes)
        if missing:
            raise ModelLoadError(
                f"model: its {INDEX} names shards the repo lacks: {sorted(missing)}"
            )
        return small | shards | {INDEX}
    if "model.safetensors" in sizes:
        return small | {"model.safetensors"}
    weights = {f for f in sizes if f.endswith(".safetensors") and "/" not in f}
    if not weights:
        found = sorted(f for f in sizes if f.endswith((".bin", ".pth", ".gguf", ".pt")))
        raise ModelLoadError(
            "model: the repo has no *.safetensors weights (kvfleet reads safetensors only"
            + (f"; it has {', '.join(found[:4])}" if found else "")
            + ")"
        )
    return small | weights


def _read_index(api: Any, repo_id: str, commit: str | None, endpoint: str, token: str | None):
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(
        repo_id, INDEX, revision=commit, cache_dir=hub_cache(), endpoint=endpoint, token=token
    )
    return json.loads(Path(path).read_text())


def _from_cache(repo_id: str, revision: str | None, where: str, why: str) -> Path:
    """The cached snapshot of `repo_id` at `revision`, found through the cache's refs (what a
    branch or tag pointed at when it was downloaded) or the commit hash itself. Read directly
    rather than with `snapshot_download(local_files_only=True)`, which refuses a snapshot that
    lacks files the runtime never fetches (model cards, .bin duplicates)."""
    repo_dir = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    name = revision or "main"
    ref = repo_dir / "refs" / name
    commit = ref.read_text().strip() if ref.is_file() else name
    folder = repo_dir / "snapshots" / commit
    if not folder.is_dir():
        raise ModelLoadError(
            f"model: {where} is not in the Hugging Face cache ({hub_cache()}) and {why}; run "
            f"`kvfleet download --model {repo_id}"
            + (f" --revision {revision}" if revision else "")
            + "` where the Hub can be reached, with the same HF_HOME"
        )
    return _complete(folder, where)


def _complete(folder: Path, where: str) -> Path:
    """`folder` if it holds a config (a model's, or a LoRA adapter's) and every weight file
    its index names."""
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise ModelLoadError(f"model: {where} has no config.json in {folder}")
    index = folder / INDEX
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ModelLoadError(
                f"model: {where} is only partly in the cache ({folder} lacks {missing[:3]}); "
                f"run `kvfleet download` again to finish it"
            )
    elif not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"model: {where} has no *.safetensors weights in {folder}")
    return folder


def _hub_error(exc: Exception, repo_id: str, where: str, endpoint: str) -> ModelLoadError:
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"{endpoint}/{repo_id}"
    if isinstance(exc, GatedRepoError):
        return ModelLoadError(
            f"model: {where} is gated: accept its terms at {page} with a Hugging Face account, "
            f"then pass that account's token (--hf-token, or HF_TOKEN; in Kubernetes "
            f"spec.model.hfTokenSecretRef)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(
            f"model: {repo_id!r} is not on the Hugging Face Hub at {endpoint} (or it is private: "
            f"pass a token that can read it with --hf-token or HF_TOKEN)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(
            f"model: {where}: no such revision of {repo_id!r} (a branch, tag or commit of {page})"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return ModelLoadError(f"model: {where}: a file it lists is missing on the Hub ({exc})")
    status = getattr(getattr(exc, "response", None), "status_code", "?")
    return ModelLoadError(f"model: the Hub at {endpoint} answered {status} for {where}: {exc}")


def _check_room(repo_id: str, files: dict[str, int]) -> None:
    cache = hub_cache()
    cache.mkdir(parents=True, exist_ok=True)
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    have = _bytes_in(repo_dir)
    needed = max(sum(files.values()) - have, 0)
    free = shutil.disk_usage(cache).free
    limit = os.environ.get(contract.CACHE_LIMIT_ENV)
    if limit:  # a volume smaller than the disk it reports (a pod's emptyDir)
        used = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        free = min(free, int(limit) - used)
    if needed > free:
        raise ModelLoadError(_no_room(repo_id, needed, max(free, 0)))


def _no_room(repo_id: str, needed: int, free: int | None = None) -> str:
    room = f", {free / 1e9:.2f} GB free" if free is not None else ""
    return (
        f"model: {repo_id!r} needs {needed / 1e9:.2f} GB in the Hugging Face cache "
        f"({hub_cache()}{room}): give it more room (in Kubernetes spec.model.sizeHint or a "
        f"cache PVC) or point HF_HOME at a larger disk"
    )


def _bytes_in(folder: Path) -> int:
    blobs = folder / "blobs"
    return sum(p.stat().st_size for p in blobs.iterdir()) if blobs.is_dir() else 0


@contextmanager
def _progress(repo_id: str, total: int) -> Iterator[None]:
    """On a terminal huggingface_hub draws its progress bars; otherwise (a pod's log) they are
    turned off and a line is logged every PROGRESS_EVERY_S seconds instead."""
    if sys.stderr.isatty():
        yield
        return
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    repo_dir = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            got = _bytes_in(repo_dir)
            rate = got / max(time.monotonic() - start, 1e-9) / 1e6
            log.info(
                "downloading %s: %.2f of %.2f GB (%.0f%%, %.1f MB/s)",
                repo_id,
                got / 1e9,
                total / 1e9,
                100 * got / max(total, 1),
                rate,
            )

    disable_progress_bars()
    thread = threading.Thread(target=report, name="download-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        enable_progress_bars()
