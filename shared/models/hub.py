"""A Hugging Face Hub id as a model path: `org/name` (a transformers checkpoint) or `org/name:Q4_K_M`
(one GGUF of a repo, as llama.cpp's `-hf` picks it), fetched through `huggingface_hub`.

    python -m shared.models.hub org/name[:TAG] [--revision R] [--download-dir D]   # prints the local path

`huggingface_hub` reads its own environment: HF_ENDPOINT, HF_TOKEN, HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_HUB_DOWNLOAD_TIMEOUT. Offline, or with the Hub unreachable, a repo fetched
before is served from the cache.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path, PurePosixPath

# org/name, each part the Hub's characters; an optional :TAG picks a GGUF (llama.cpp's -hf syntax)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.-]+))?$")
DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's -hf pick when the id names none
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
# a transformers checkpoint: its weights (safetensors, else PyTorch's .bin), config and tokenizer files
_CHECKPOINT_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubError(FileNotFoundError):
    """A Hub id that cannot be served; the message names the repo and what to do."""


def is_hub_id(model_path: str | None) -> bool:
    """`org/name[:TAG]` that is not a path on this machine (a local folder of that name wins, as in vLLM)."""
    return bool(model_path) and not os.path.exists(model_path) and _HUB_ID.match(model_path) is not None


def fetch(model_id: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local path of a Hub id's model: a snapshot folder (a checkpoint) or one GGUF file in it.
    Downloads what is missing; HubError with the remedy on anything that stops it."""
    from huggingface_hub import constants

    match = _HUB_ID.match(model_id)
    if match is None:
        raise HubError(f"{model_id!r} is not a Hugging Face Hub id (org/name, or org/name:TAG for a GGUF)")
    repo, tag = match["repo"], match["tag"]
    where = model_id + (f" at revision {revision!r}" if revision else "")
    try:
        files = None if constants.is_offline_mode() else _listing(repo, revision)
        patterns = _cached_patterns(tag) if files is None else _wanted(repo, files, tag)
        folder = _snapshot(repo, revision, download_dir, patterns, local_only=files is None)
        return _model_in(repo, Path(folder), tag)
    except HubError:
        raise
    except Exception as exc:  # huggingface_hub's errors, by kind: each gets its remedy
        raise HubError(_explain(exc, repo, where, constants)) from None


def _listing(repo: str, revision: str | None) -> list[str] | None:
    """The repo's file names at `revision`; None when the Hub cannot be reached (the cache may serve)."""
    from huggingface_hub import HfApi, errors

    try:
        info = HfApi().model_info(repo, revision=revision)
    except errors.HfHubHTTPError:  # the Hub answered: its answer says why
        raise
    except Exception as exc:
        # no answer at all (refused, timed out): huggingface_hub's HTTP client's own errors, whichever it uses
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "requests"):
            return None
        raise
    return [s.rfilename for s in info.siblings or []]


def _snapshot(repo: str, revision: str | None, download_dir: str | None, patterns: list[str] | None,
              local_only: bool) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
                             local_files_only=local_only)


def _wanted(repo: str, files: list[str], tag: str | None) -> list[str]:
    """What to download: one GGUF (by tag), or a checkpoint's weights, config and tokenizer."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    has_checkpoint = "config.json" in files and any(f.endswith((".safetensors", ".bin")) for f in files)
    if tag is None and has_checkpoint:
        weights = "*.safetensors" if any(f.endswith(".safetensors") for f in files) else "*.bin"
        return [weights, *_CHECKPOINT_FILES]
    if not ggufs:
        raise HubError(f"{repo} has neither a transformers checkpoint (config.json and weights) nor a GGUF file"
                       + (f" for the tag {tag!r}" if tag else ""))
    return [_pick_gguf(repo, ggufs, tag)]


def _cached_patterns(tag: str | None) -> list[str]:
    """What a cached snapshot must hold for the id, with no listing to pick from (offline)."""
    if tag is None:
        return ["*.safetensors", *_CHECKPOINT_FILES]
    return sorted({f"*{t}*.gguf" for t in (tag, tag.upper(), tag.lower())})


def _pick_gguf(repo: str, ggufs: list[str], tag: str | None) -> str:
    """The GGUF whose name carries the tag (Q4_K_M by default, else the repo's only one)."""
    def tagged(name: str, wanted: str) -> bool:
        stem = PurePosixPath(name).name[: -len(".gguf")]
        return re.search(rf"(^|[-._]){re.escape(wanted)}($|[-._])", stem, re.IGNORECASE) is not None

    wanted = tag or DEFAULT_GGUF_TAG
    found = [g for g in ggufs if tagged(g, wanted)]
    if not found and tag is None and len(ggufs) == 1:
        found = ggufs
    if not found:
        raise HubError(f"{repo} has no GGUF {'tagged ' + repr(wanted) if tag else 'to pick by default'}: name one "
                       f"as {repo}:TAG, from {', '.join(sorted(PurePosixPath(g).name for g in ggufs))}")
    if len(found) > 1 or _SPLIT_GGUF.search(found[0]):
        raise HubError(f"{repo}:{wanted} is split over {len(found)} files ({', '.join(sorted(found))}); this engine "
                       "reads one GGUF file: merge them with llama.cpp's `llama-gguf-split --merge`")
    return found[0]


def _model_in(repo: str, folder: Path, tag: str | None) -> str:
    """A snapshot as the loaders take it: the folder of a checkpoint, or its GGUF file."""
    if tag is None and (folder / "config.json").exists():
        return str(folder)
    ggufs = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.gguf"))
    if not ggufs:
        raise HubError(f"the cached snapshot of {repo} ({folder}) holds no model for this id: fetch it once with "
                       "the Hub reachable (HF_HUB_OFFLINE unset)")
    return str(folder / _pick_gguf(repo, ggufs, tag))


def _explain(exc: Exception, repo: str, where: str, constants) -> str:
    from huggingface_hub import errors

    kind = type(exc).__name__
    if isinstance(exc, errors.GatedRepoError):
        return (f"{repo} is gated: accept its conditions on the Hub with your account, then give its token "
                "(HF_TOKEN, or `hf auth login`)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        token = "a token is set, but it does not reach it" if _has_token() else "no token is set (HF_TOKEN)"
        return (f"{repo} is not on the Hub at {constants.ENDPOINT}, or it is private and {token}: check the id, "
                "or give a token that can read it (HF_TOKEN, or `hf auth login`)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{where}: no such revision (a branch, tag or commit of the repo): check --revision"
    if isinstance(exc, errors.LocalEntryNotFoundError):  # offline (or unreachable) and not in the cache
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else f"the Hub ({constants.ENDPOINT}) cannot be reached"
        return (f"{where} is not in the cache ({constants.HF_HUB_CACHE}) and {why}: fetch it once with the Hub "
                f"reachable (`python -m shared.models.hub {repo}`), or point HF_HOME / --download-dir at a cache that has it")
    if isinstance(exc, errors.HfHubHTTPError):
        return f"{where}: the Hub answered {kind}: {str(exc).splitlines()[0]}"
    return (f"{where}: the download from {constants.ENDPOINT} stopped ({kind}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); nothing partial is served: run again once "
            "the Hub answers (HF_HUB_DOWNLOAD_TIMEOUT sets how long a stalled read waits)")


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shared.models.hub", description="Fetch a Hub id into the cache "
                                     "(as a worker would at its start) and print its local path")
    parser.add_argument("model", help="org/name (a transformers checkpoint) or org/name:TAG (one GGUF, e.g. Q4_K_M)")
    parser.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    parser.add_argument("--download-dir", default=None, help="the cache to use (default: huggingface_hub's, HF_HOME)")
    args = parser.parse_args(argv)
    try:
        print(fetch(args.model, args.revision, args.download_dir))
    except HubError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
