"""A Hugging Face Hub on 127.0.0.1 for tests: serves local model folders with the Hub's HTTP API
(model info, the file tree, `resolve` with ETags and Range requests, the Hub's error codes), so
that `HF_ENDPOINT=<url>` runs the real `huggingface_hub` download code without the internet.

    with fake_hub({"org/smollm2": folder}, gated={"org/gated"}, token="hf_x") as hub:
        env["HF_ENDPOINT"] = hub.url

A repo maps to a folder (its `main`) or to {revision name: folder}. Each revision gets a commit
hash derived from its files. `hub.cut_after[path] = n` makes the next full GET of that file stop
after n bytes (a download interrupted mid-file); `hub.requests` records what was asked.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub stores bigger files in LFS (ETag = sha256)


@dataclass(slots=True)
class _File:
    path: Path
    size: int
    git_oid: str  # sha1 of the git blob, the ETag of a non-LFS file
    sha256: str

    @property
    def lfs(self) -> bool:
        return self.size >= LFS_THRESHOLD or self.path.suffix == ".safetensors"

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


def _scan(folder: Path) -> dict[str, _File]:
    files = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        files[p.relative_to(folder).as_posix()] = _File(
            p, len(data), oid, hashlib.sha256(data).hexdigest()
        )
    return files


@dataclass(slots=True)
class _Revision:
    commit: str
    files: dict[str, _File]


@dataclass
class FakeHub:
    repos: Mapping[str, Path | Mapping[str, Path]]
    gated: set[str] = field(default_factory=set)
    token: str | None = None
    url: str = ""
    cut_after: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    _revisions: dict[str, dict[str, _Revision]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for repo, source in self.repos.items():
            by_name = {"main": source} if isinstance(source, Path | str) else dict(source)
            revisions = {}
            for name, folder in by_name.items():
                files = _scan(Path(folder))
                digest = hashlib.sha1(repo.encode() + name.encode())
                for rel, f in files.items():
                    digest.update(rel.encode() + f.git_oid.encode())
                rev = _Revision(digest.hexdigest(), files)
                revisions[name] = rev
                revisions[rev.commit] = rev  # a commit hash is a revision too
            self._revisions[repo] = revisions

    def commit(self, repo: str, revision: str = "main") -> str:
        return self._revisions[repo][revision].commit

    # --- the Hub's API ------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/revision/{revision}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{revision}", self._tree)
        app.router.add_get("/api/models/{org}/{name}/tree/{revision}/{path:.*}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{path:.+}", self._resolve)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        self.requests.append((request.method, request.path, request.headers.get("Range")))
        return await handler(request)

    def _lookup(self, request: web.Request) -> _Revision:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in self._revisions:
            raise _error(404, "RepoNotFound", f"Repository not found: {repo}")
        if repo in self.gated and request.headers.get("Authorization") != f"Bearer {self.token}":
            raise _error(
                401, "GatedRepo", f"Access to model {repo} is restricted. You must have access."
            )
        name = request.match_info.get("revision", "main")
        rev = self._revisions[repo].get(name)
        if rev is None:
            raise _error(404, "RevisionNotFound", f"Invalid rev id: {name}")
        return rev

    async def _info(self, request: web.Request) -> web.Response:
        rev = self._lookup(request)
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response(
            {
                "id": repo,
                "modelId": repo,
                "sha": rev.commit,
                "private": False,
                "gated": "manual" if repo in self.gated else False,
                "siblings": [
                    {"rfilename": rel, "size": f.size, "blobId": f.git_oid}
                    for rel, f in rev.files.items()
                ],
            }
        )

    async def _tree(self, request: web.Request) -> web.Response:
        rev = self._lookup(request)
        prefix = request.match_info.get("path", "").strip("/")
        entries = []
        for rel, f in rev.files.items():
            if prefix and not rel.startswith(prefix + "/"):
                continue
            entry = {"type": "file", "path": rel, "size": f.size, "oid": f.git_oid}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        rev = self._lookup(request)
        rel = request.match_info["path"]
        f = rev.files.get(rel)
        if f is None:
            raise _error(404, "EntryNotFound", f"{rel} does not exist on {rev.commit}")
        headers = {
            "X-Repo-Commit": rev.commit,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.etag}"'
            headers["X-Linked-Size"] = str(f.size)
        start, status = 0, 200
        range_header = request.headers.get("Range")
        if range_header and range_header.startswith("bytes="):
            start = int(range_header[6:].split("-")[0])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
        if request.method == "HEAD":
            headers["Content-Length"] = str(f.size - start)
            return web.Response(status=status, headers=headers)
        data = f.path.read_bytes()[start:]
        cut = self.cut_after.pop(rel, None) if start == 0 else None
        if cut is None:
            return web.Response(status=status, body=data, headers=headers)
        # Promise the whole file, send part of it, then drop the connection.
        resp = web.StreamResponse(status=status, headers={**headers})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[:cut])
        assert request.transport is not None
        request.transport.close()
        return resp


def _error(status: int, code: str, message: str) -> web.HTTPException:
    cls = {401: web.HTTPUnauthorized, 404: web.HTTPNotFound}[status]
    return cls(
        text=f'{{"error": "{message}"}}',
        content_type="application/json",
        headers={"X-Error-Code": code, "X-Error-Message": message},
    )


@contextmanager
def fake_hub(
    repos: Mapping[str, Path | Mapping[str, Path]],
    gated: set[str] | None = None,
    token: str | None = None,
) -> Iterator[FakeHub]:
    """Serve `repos` on 127.0.0.1 (a free port) in a background thread while the block runs."""
    hub = FakeHub(repos, set(gated or ()), token)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(hub.app(), access_log=None)

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        hub.url = f"http://127.0.0.1:{port}"

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, name="fake-hub", daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the fake hub did not start")
    try:
        yield hub
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
