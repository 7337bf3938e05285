"""Uploaded artifacts on disk: a zipped Hugging Face directory is extracted once, whoever comes first."""

from __future__ import annotations

import zipfile
from pathlib import Path

from shared.models.model_files import unpacked


def test_two_processes_extracting_one_zip_both_get_the_folder(tmp_path, monkeypatch):
    artifact = tmp_path / "model.zip"
    with zipfile.ZipFile(artifact, "w") as zf:
        zf.writestr("tiny/config.json", "{}")
    real_extract = zipfile.ZipFile.extractall

    def beaten_to_it(self, path):  # the other process renames its copy into place while we extract
        real_extract(self, str(artifact) + ".d")
        real_extract(self, path)

    monkeypatch.setattr(zipfile.ZipFile, "extractall", beaten_to_it)
    assert unpacked(str(artifact)) == str(Path(str(artifact) + ".d") / "tiny")
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []  # our copy is gone
