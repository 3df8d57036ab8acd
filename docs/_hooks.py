"""MkDocs hooks of the documentation site (`make docs`; mkdocs.yml names this file).

- **The home page is README.md**, the changelog page CHANGELOG.md: both are read from the
  repository's root at build time, so there is one copy to maintain. Their links are written
  for GitHub, relative to the root (`docs/guide/jobs.md`); here they are rewritten relative to
  `docs/` (`guide/jobs.md`), and a link to a folder (`docs/bench/`) to that folder's index.
- **A folder in the nav** (`- Benchmarks: bench/`) becomes a section of every page in that
  folder, headed by an index page listing them by title (generated where the folder has no
  `index.md` or `README.md`, which MkDocs also takes as the folder's index). Pages added to such
  a folder need no edit of mkdocs.yml.
- **The API reference reads the sources by import name.** The source folders are not named
  as the packages are (`runtime/` is `orchestr`, `roles/` is `orchestr.roles`: pyproject.toml's
  `package-dir`), which mkdocstrings' loader cannot follow, so a tree of symlinks with the
  import names' layout is laid under `build/docs-src/` from where Python's import system finds
  each package (the editable install), wherever its folder is.

`RstRoles` is a Griffe extension (mkdocs.yml loads it from this file): the docstrings are
written with Sphinx roles (``:class:`Generator` ``), shown here as code.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.livereload import LiveReloadServer
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
SOURCE_TREE = ROOT / "build" / "docs-src"
# (page in the site, file at the repository's root)
ROOT_PAGES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}
# documented subpackages that package-dir may not name (one inside its parent's folder)
EXTRA_PACKAGES = ("orchestr.fabric", "orchestr.roles", "orchestr.sim")

_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
_H1 = re.compile(r"^#\s+(.+?)\s*$", re.MULTILINE)


def _package_dir(name: str, mapped: dict[str, str]) -> Path:
    """Where `name` is imported from; else (an install older than pyproject.toml's mapping)
    where package-dir says."""
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    if name in mapped and (ROOT / mapped[name] / "__init__.py").exists():
        return (ROOT / mapped[name]).resolve()
    raise RuntimeError(f"package {name} not found: run `make setup`")


def lay_source_tree(target: Path = SOURCE_TREE) -> list[Path]:
    """Symlink the packages into `target` in the layout of their import names; returns the
    packages' folders."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        mapped = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    names = sorted({*mapped, *EXTRA_PACKAGES}, key=lambda n: n.count("."))
    if target.exists():
        shutil.rmtree(target)
    sources = []
    for name in names:
        source = _package_dir(name, mapped)
        sources.append(source)
        dest = target.joinpath(*name.split("."))
        if dest.is_symlink() or dest.exists():
            if dest.resolve() == source:
                continue  # already there with its parent's folder
            dest.unlink()
        dest.mkdir(parents=True)
        for entry in source.iterdir():
            if entry.name != "__pycache__":
                (dest / entry.name).symlink_to(entry)
    return sources


def _title(path: Path) -> str:
    m = _H1.search(path.read_text(encoding="utf-8"))
    return m.group(1).replace("`", "") if m else path.stem


# the first lines of a generated folder index, by folder
INTROS = {
    "decisions": "Architecture decision records, one a page: the context, the decision, its "
    "consequences and the measurement behind it.",
    "bench": "One page a benchmark: the machine, the versions, the command and the runs, beside "
    "its peers. The scripts are in `bench/`.",
}


INDEX_NAMES = ("index.md", "README.md")  # what MkDocs serves as a folder's index.html


def _own_index(folder: Path) -> str | None:
    return next((name for name in INDEX_NAMES if (folder / name).is_file()), None)


def _pages(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.md") if p.name not in INDEX_NAMES)


def _folder_index(folder: str, docs_dir: Path, title: str) -> str:
    pages = [docs_dir / folder / name for name in _pages(docs_dir / folder)]
    lines = [f"# {title}", ""]
    if folder in INTROS:
        lines += [INTROS[folder], ""]
    lines += [f"- [{_title(p)}]({p.name})" for p in pages]
    return "\n".join(lines) + "\n"


def _expand(nav: Any, docs_dir: Path, found: dict[str, str]) -> Any:
    """Replace `Title: folder/` entries with the folder's pages, an index first."""
    if isinstance(nav, list):
        return [_expand(item, docs_dir, found) for item in nav]
    if isinstance(nav, dict):
        out = {}
        for title, value in nav.items():
            if isinstance(value, str) and value.endswith("/"):
                folder = value.rstrip("/")
                found[folder] = title
                index = _own_index(docs_dir / folder) or "index.md"
                pages = [f"{folder}/{name}" for name in _pages(docs_dir / folder)]
                value = [f"{folder}/{index}", *pages]
            out[title] = _expand(value, docs_dir, found)
        return out
    return nav


_folders: dict[str, str] = {}  # folder in docs/ -> its section's title
_sources: list[Path] = []  # the packages' folders


def on_serve(server: LiveReloadServer, *, config: MkDocsConfig, builder: Any) -> None:
    for folder in _sources:  # `mkdocs serve` rebuilds when a docstring changes
        server.watch(str(folder))


@event_priority(100)
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    _sources[:] = lay_source_tree()
    _folders.clear()
    config["nav"] = _expand(config["nav"], Path(config["docs_dir"]), _folders)
    return config


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    docs_dir = Path(config["docs_dir"])
    for uri, source in ROOT_PAGES.items():
        if files.get_file_from_path(uri) is None:  # a page of that name in docs/ wins
            text = (ROOT / source).read_text(encoding="utf-8")
            files.append(File.generated(config, uri, content=text))
    for folder, title in _folders.items():
        if _own_index(docs_dir / folder) is None:
            content = _folder_index(folder, docs_dir, title)
            files.append(File.generated(config, f"{folder}/index.md", content=content))
    return files


def _root_link(target: str) -> str:
    """A link written relative to the repository's root, as seen from docs/index.md."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return target
    for page, source in ROOT_PAGES.items():
        if target == source:
            return page
    if target.startswith("docs/"):
        target = target.removeprefix("docs/")
    return target


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    from_root = page.file.src_uri in ROOT_PAGES

    def fix(m: re.Match[str]) -> str:
        target = _root_link(m.group(2)) if from_root else m.group(2)
        if target.endswith("/") and "://" not in target:
            here = os.path.dirname(page.file.src_uri)
            folder = os.path.normpath(os.path.join(here, target)).replace(os.sep, "/")
            index = _own_index(Path(config["docs_dir"]) / folder)
            if index is None and files.get_file_from_path(f"{folder}/index.md") is not None:
                index = "index.md"  # generated
            if index is not None:
                target += index
        return f"{m.group(1)}{target}{m.group(3) or ''}{m.group(4)}"

    return _LINK.sub(fix, markdown)


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj|const):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)  # ~a.b.C shows C
    return f"`{name}`"


class RstRoles(griffe.Extension):
    """Show Sphinx cross-reference roles and literal-block markers as Markdown does; leave out
    the ``__module__`` that pins a class's import path (not an attribute of its API)."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if "__module__" in cls.members:
            cls.del_member("__module__")

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        doc = obj.docstring
        if doc is not None:
            text = _ROLE.sub(_role, doc.value)
            doc.value = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self.on_object(obj=pkg)  # the top package is not among the objects
