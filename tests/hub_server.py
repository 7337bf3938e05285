"""A local server speaking the Hugging Face Hub's HTTP API, the routes `huggingface_hub` downloads
through (repo info, the file tree, resolve with HEAD and ranged GET), for tests without network."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, Path]  # path in the repo -> the file served
    sha: str = "0123456789abcdef0123456789abcdef01234567"  # main's commit
    private_token: str | None = None  # set: only a request with this bearer token sees the repo
    cut_after: dict[str, int] = field(default_factory=dict)  # a file's GET stops after these bytes, the server dies


class HubServer:
    def __init__(self, repos: dict[str, Repo], port: int = 0):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self._port = port
        self.httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> HubServer:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._port = self.httpd.server_address[1]  # a restart comes back on the same port
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    # ---- routing --------------------------------------------------------------------------------

    def _route(self, body: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.server_hub.requests.append((self.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            if (repo := self._repo(repo_id)) is None:
                return
            if not rest:
                return self._info(repo_id, repo, "main")
            if rest[0] == "revision" and len(rest) == 2:
                return self._info(repo_id, repo, rest[1])
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo, rest[1])
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id = "/".join(parts[:2])
            if (repo := self._repo(repo_id)) is None:
                return
            return self._resolve(repo, parts[3], "/".join(parts[4:]), body)
        self._error(404, "EntryNotFound", "no such route")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.server_hub.repos.get(repo_id)
        token = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if repo is None or (repo.private_token is not None and token != repo.private_token):
            self._error(401, "RepoNotFound", "Repository not found")  # the Hub's answer to both
            return None
        return repo

    def _commit(self, repo: Repo, revision: str) -> str | None:
        if revision in ("main", repo.sha):
            return repo.sha
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return None

    # ---- answers --------------------------------------------------------------------------------

    def _info(self, repo_id: str, repo: Repo, revision: str) -> None:
        if (sha := self._commit(repo, revision)) is None:
            return
        self._json({"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": sha,
                    "private": repo.private_token is not None, "gated": False, "disabled": False,
                    "siblings": [{"rfilename": f} for f in sorted(repo.files)], "tags": [], "downloads": 0,
                    "likes": 0, "lastModified": "2026-11-01T00:00:00.000Z"})

    def _tree(self, repo: Repo, revision: str) -> None:
        if self._commit(repo, revision) is None:
            return
        entries = []
        for name, file in sorted(repo.files.items()):
            size = file.stat().st_size
            entries.append({"type": "file", "path": name, "size": size, "oid": hashlib.sha1(name.encode()).hexdigest(),
                            "lfs": {"oid": _sha256(file), "size": size, "pointerSize": 134}})
        self._json(entries)

    def _resolve(self, repo: Repo, revision: str, name: str, body: bool) -> None:
        if (sha := self._commit(repo, revision)) is None:
            return
        if name not in repo.files:
            return self._error(404, "EntryNotFound", f"{name} does not exist on {revision}")
        data = repo.files[name].read_bytes()
        start = 0
        if (ranged := self.headers.get("Range", "")).startswith("bytes="):
            start = int(ranged[len("bytes="):].split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        cut = repo.cut_after.pop(name, None)
        if cut is None:
            self.wfile.write(data[start:])
            return
        self.wfile.write(data[start:start + cut])  # then the connection and the server are gone
        self.wfile.flush()
        self.close_connection = True
        threading.Thread(target=self.server_hub.stop, daemon=True).start()

    def _json(self, value) -> None:
        payload = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: int, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
