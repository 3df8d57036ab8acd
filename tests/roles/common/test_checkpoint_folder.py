"""Where ``make_tiny`` writes: a new folder (0755, files 0644), an empty one, or, with
``force``, one holding a checkpoint already; never through a link, never into a folder other
users may write to, and nothing left behind when it fails. (Another user's traps are in
``tests/security/test_checkpoint_folder.py``.)"""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys

import pytest

import orchestr as oc
from orchestr.roles import models

TINY = {"layers": 1, "hidden": 32, "tokenizer": "digits", "max_positions": 64}


def modes(folder: pathlib.Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.lstat().st_mode) for p in [folder, *folder.iterdir()]}


def test_a_new_folder_is_0755_with_files_0644_whatever_the_umask(tmp_path: pathlib.Path) -> None:
    old = os.umask(0o077)
    try:
        folder = pathlib.Path(models.make_tiny("llama", tmp_path / "a" / "tiny", shards=2, **TINY))
    finally:
        os.umask(old)
    assert modes(folder) == {
        "tiny": 0o755,
        "config.json": 0o644,
        "model-00001-of-00002.safetensors": 0o644,
        "model-00002-of-00002.safetensors": 0o644,
        "model.safetensors.index.json": 0o644,
        "tokenizer.json": 0o644,
        "tokenizer_config.json": 0o644,
    }
    models.load_model(folder)  # what was written loads


def test_an_empty_folder_of_ours_is_used_as_it_is(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir(mode=0o700)
    assert models.make_tiny("llama", folder, **TINY) == str(folder)
    assert modes(folder)["empty"] == 0o700  # its owner's choice, kept
    assert models.read_config(folder).num_hidden_layers == 1


def test_a_folder_that_is_not_empty_needs_force(tmp_path: pathlib.Path) -> None:
    folder = pathlib.Path(models.make_tiny("llama", tmp_path / "m", shards=2, **TINY))
    with pytest.raises(oc.ConfigError, match=r"already holds a checkpoint.*force=True \(--force\)"):
        models.make_tiny("llama", folder, **TINY)
    (folder / "NOTES.md").write_text("mine")
    models.make_tiny("llama", folder, force=True, **{**TINY, "layers": 2})
    # the old shards and index are gone, the new single file is there, other files are kept
    assert sorted(p.name for p in folder.iterdir()) == [
        "NOTES.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (folder / "NOTES.md").read_text() == "mine"
    assert models.load_model(folder).config.num_hidden_layers == 2

    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_bytes(b"x")
    with pytest.raises(oc.ConfigError, match=r"is not empty \(it holds 'data.bin'\)"):
        models.make_tiny("llama", other, **TINY)


def test_force_replaces_links_and_never_writes_through_them(tmp_path: pathlib.Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    victim.chmod(0o600)
    folder = tmp_path / "ours"
    folder.mkdir(mode=0o755)
    (folder / "tokenizer.json").symlink_to(victim)
    (folder / "config.json").symlink_to(tmp_path / "absent.json")  # dangling
    with pytest.raises(oc.ConfigError, match="already holds a checkpoint"):
        models.make_tiny("llama", folder, **TINY)
    models.make_tiny("llama", folder, force=True, **TINY)
    assert victim.read_text() == "keep me" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not (tmp_path / "absent.json").exists()
    for name in ("tokenizer.json", "config.json"):
        assert stat.S_ISREG((folder / name).lstat().st_mode), name
    models.Tokenizer(folder)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_folder_others_may_write_to_is_refused_even_with_force(
    tmp_path: pathlib.Path, mode: int
) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(mode)
    for force in (False, True):
        with pytest.raises(oc.ConfigError, match=r"writable by other users.*chmod go-w"):
            models.make_tiny("llama", folder, force=force, **TINY)
    assert list(folder.iterdir()) == []


def test_a_link_or_a_file_is_not_a_folder_to_write(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(oc.ConfigError, match="is a symbolic link; give the real folder's path"):
        models.make_tiny("llama", tmp_path / "link", force=True, **TINY)
    (tmp_path / "file").write_text("")
    with pytest.raises(oc.ConfigError, match="is not a folder"):
        models.make_tiny("llama", tmp_path / "file", force=True, **TINY)
    assert list(real.iterdir()) == []


def test_a_failed_make_tiny_leaves_nothing_behind(tmp_path: pathlib.Path) -> None:
    with pytest.raises(oc.ConfigError, match="not a multiple"):
        models.make_tiny("llama", tmp_path / "bad", heads=3, hidden=48, tokenizer="digits")
    assert not (tmp_path / "bad").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(oc.ConfigError, match="not a multiple"):
        models.make_tiny("llama", kept, heads=3, hidden=48, tokenizer="digits")
    assert kept.is_dir() and list(kept.iterdir()) == []


@pytest.mark.timeout(120)  # two CLI processes, each importing torch
def test_the_command_takes_force(tmp_path: pathlib.Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "orchestr.cli", "model", "make-tiny", "--arch", "llama"]
        cmd += ["--hidden", "32", "--tokenizer", "digits", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=100)

    folder = pathlib.Path(models.make_tiny("llama", tmp_path / "m", **TINY))
    refused = cli(str(folder), "--layers", "3")
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert models.read_config(folder).num_hidden_layers == 1
    done = cli(str(folder), "--layers", "3", "--force")
    assert done.returncode == 0, done.stderr
    assert f"wrote {folder}: llama, 3 layers" in done.stdout
    assert models.read_config(folder).num_hidden_layers == 3
