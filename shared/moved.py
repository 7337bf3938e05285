"""The module paths shared/ had before its packages (2026-11-29): importing or running one (`python
-m shared.nats_auth`) still works, gives the module at its new path and warns; removed 2027-03-01."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    **{m: "wire" for m in ("messages", "subjects", "kv_events", "lora", "guided", "histogram", "hashing")},
    **{m: "bus" for m in ("client", "stream", "liveness", "endpoints", "lifecycle", "nats_auth")},
    **{m: "models" for m in ("model_files", "gguf_fields", "architectures", "tokenizer", "spm_tokenizer",
                             "detokenizer", "hub", "custom_artifact", "custom_environment")},
    **{m: "control" for m in ("registry", "deployment", "deploy_config", "agents", "oci", "pipeline_artifact",
                              "arrow_schema")},
}
REMOVED_ON = "2027-03-01"


def new_name(old: str) -> str | None:
    """shared.client -> shared.bus.client; None for a path that did not move."""
    head, _, rest = old.partition(".")
    module = rest.split(".")[0]
    if head != "shared" or module not in MOVED:
        return None
    return f"shared.{MOVED[module]}.{rest}"


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one (one module object, so types stay identical)."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(f"{self.old} moved to {self.new}; the old path goes on {REMOVED_ON}",
                      FutureWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        pass  # the new module has run already

    def get_code(self, fullname):  # `python -m shared.OLD` runs the new module's code as __main__
        warnings.warn(f"python -m {self.old} is now python -m {self.new}; the old path goes on {REMOVED_ON}",
                      FutureWarning, stacklevel=2)
        return importlib.util.find_spec(self.new).loader.get_code(self.new)

    def is_package(self, fullname) -> bool:
        return False


class MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(fullname, new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
