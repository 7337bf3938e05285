"""What a custom model's artifact holds besides its model (shared/models/model_files.py): script(s), requirements.txt."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

# served by Switchyard itself (sdk/): never installed per model
SERVED_HERE = {"vllm", "wallaroo"}


def scripts_in(root: Path) -> list[Path]:
    scripts = sorted(p for p in root.rglob("*.py") if "model" not in p.relative_to(root).parts[:1])
    if not scripts:
        raise ValueError("a custom model's zip needs a .py script with classes extending mac.inference.AsyncInference "
                         "and mac.inference.creation.InferenceBuilder")
    return scripts


def requirements_in(root: Path) -> list[str]:
    """requirements.txt's requirements less those served here; options and other files are refused."""
    found = sorted(root.rglob("requirements.txt"), key=lambda p: len(p.parts))
    if not found:
        return []
    wanted = []
    for number, raw in enumerate(found[0].read_text().splitlines(), 1):
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise ValueError(f"requirements.txt line {number}: {line!r}: options are not taken (the package index "
                             "is the server's); list requirements only")
        try:
            requirement = Requirement(line)
        except InvalidRequirement as exc:
            raise ValueError(f"requirements.txt line {number}: {line!r} is not a requirement: {exc}") from None
        if requirement.name.lower() not in SERVED_HERE:
            wanted.append(line)
    return wanted
