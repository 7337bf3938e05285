"""A client of the OCI distribution API, enough to push and pull one artifact: blobs and a manifest.

A reference is `host[:port]/repository:tag` (or `@sha256:...`), as docker and oras spell it. The
registry is spoken to over HTTPS, or plain HTTP with `plain_http` (a local registry, a test's).
Basic auth comes from SY_OCI_USERNAME / SY_OCI_PASSWORD; token auth (a Docker Hub style realm) is
not spoken.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CHUNK = 1 << 20
_REFERENCE = re.compile(r"^(?P<host>[A-Za-z0-9.-]+(:\d+)?)/(?P<repo>[a-z0-9]+([._/-][a-z0-9]+)*)"
                        r"(:(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})|@(?P<digest>sha256:[0-9a-f]{64}))$")


class OciError(Exception):
    """The registry refused, or what it sent is not what was asked for."""


@dataclass(frozen=True)
class Reference:
    host: str
    repository: str
    tag: str  # or a digest, sha256:...

    @classmethod
    def parse(cls, text: str) -> Reference:
        m = _REFERENCE.match(text)
        if m is None:
            raise ValueError(f"{text!r} is not an OCI reference: host[:port]/repository:tag")
        return cls(m["host"], m["repo"], m["tag"] or m["digest"])

    def __str__(self) -> str:
        sep = "@" if self.tag.startswith("sha256:") else ":"
        return f"{self.host}/{self.repository}{sep}{self.tag}"


def descriptor(media_type: str, digest: str, size: int, title: str | None = None) -> dict:
    d = {"mediaType": media_type, "digest": digest, "size": size}
    if title is not None:
        d["annotations"] = {"org.opencontainers.image.title": title}
    return d


class Registry:
    """One registry host; used as a context manager (it holds an HTTP connection pool)."""

    def __init__(self, host: str, plain_http: bool = False, timeout: float = 600.0):
        user, password = os.environ.get("SY_OCI_USERNAME"), os.environ.get("SY_OCI_PASSWORD")
        self.http = httpx.Client(base_url=f"{'http' if plain_http else 'https'}://{host}", timeout=timeout,
                                 auth=(user, password or "") if user else None, follow_redirects=True)

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code >= 400:
            raise OciError(f"{what}: {response.status_code} {response.text[:300]}")
        return response

    # ---- push ----------------------------------------------------------------------------------

    def push_blob(self, repository: str, digest: str, size: int, content) -> None:
        """content: bytes or an open binary file; skipped when the registry has the blob already."""
        if self.http.head(f"/v2/{repository}/blobs/{digest}").status_code == 200:
            return
        started = self._check(self.http.post(f"/v2/{repository}/blobs/uploads/"), "starting a blob upload")
        location = started.headers["Location"]  # it carries the upload's state in its query: added to, kept
        location += ("&" if "?" in location else "?") + f"digest={digest}"
        body = content if isinstance(content, bytes) else _chunks(content)
        self._check(self.http.put(location, content=body,
                                  headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}),
                    f"uploading blob {digest}")

    def push_manifest(self, ref: Reference, manifest: dict) -> str:
        """Returns the manifest's digest, which names this exact artifact."""
        data = json.dumps(manifest, separators=(",", ":")).encode()
        self._check(self.http.put(f"/v2/{ref.repository}/manifests/{ref.tag}", content=data,
                                  headers={"Content-Type": MANIFEST_TYPE}), f"pushing {ref}")
        return f"sha256:{hashlib.sha256(data).hexdigest()}"

    # ---- pull ----------------------------------------------------------------------------------

    def manifest(self, ref: Reference) -> tuple[dict, str]:
        response = self._check(self.http.get(f"/v2/{ref.repository}/manifests/{ref.tag}",
                                             headers={"Accept": MANIFEST_TYPE}), f"pulling {ref}")
        digest = f"sha256:{hashlib.sha256(response.content).hexdigest()}"
        if ref.tag.startswith("sha256:") and digest != ref.tag:
            raise OciError(f"{ref}: the registry sent a manifest with digest {digest}")
        return response.json(), digest

    def blob(self, repository: str, desc: dict, to: Path) -> Path:
        """Streams a blob to a file, checking its digest and size (a file already there is kept)."""
        if to.exists() and to.stat().st_size == desc["size"]:
            return to
        partial = to.with_name(f".{to.name}.{os.getpid()}.partial")
        h = hashlib.sha256()
        with self.http.stream("GET", f"/v2/{repository}/blobs/{desc['digest']}") as response:
            self._check(response, f"pulling blob {desc['digest']}")
            with open(partial, "wb") as out:
                for chunk in response.iter_bytes(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
        if f"sha256:{h.hexdigest()}" != desc["digest"] or partial.stat().st_size != desc["size"]:
            partial.unlink()
            raise OciError(f"blob {desc['digest']}: what came is not what the manifest names")
        partial.rename(to)
        return to


def _chunks(f):
    while chunk := f.read(CHUNK):
        yield chunk
