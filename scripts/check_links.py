"""Check the documentation's links: every relative Markdown link (and its #anchor) and every
repository path written in backticks or in the text (`docs/...`, `crates/...`, `scripts/...`, `configs/...`,
`examples/...`) in README.md, docs/ and examples/ must exist. Prints each broken one, exits 1 if any.

Run: python scripts/check_links.py
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
BARE = re.compile(
    r"(?<![\w/.`-])((?:docs|crates|scripts|configs|examples)/[\w./-]*\.(?:md|py|rs|sh|yaml|json|png|toml))"
)
PATH_PREFIXES = ("docs/", "crates/", "scripts/", "configs/", "examples/", ".ci/", "fuzz/")
SKIP_DIRS = ("docs/bench/results/", "docs/jax_tunix/", "docs/train/")  # recorded data and generated reports


def markdown_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
    return [f for f in files if f.exists() and not str(f.relative_to(ROOT)).startswith(SKIP_DIRS)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*\[\]()]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {slug(line.lstrip("#")) for line in lines if re.match(r"#{1,6} ", line)}


def repo_path(span: str) -> str | None:
    """The repository path a backtick span names, or None where it names none (a command, a glob)."""
    if not span.startswith(PATH_PREFIXES) or re.search(r"[\s{}*<>|$]", span):
        return None
    path = re.split(r"::|:(?=\d)|#", span)[0].rstrip(".,;)")
    return path if "..." not in path and not re.search(r"(^|/)target(/|$)", path) else None  # build outputs


def check(md: pathlib.Path) -> list[str]:
    errors = []
    text = md.read_text()
    rel = md.relative_to(ROOT)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (md.parent / file).resolve() if file else md
        if not dest.exists():
            errors.append(f"{rel}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{rel}: link to {target}: no heading #{anchor}")
    for span in CODE.findall(text):
        path = repo_path(span)
        if path and not (ROOT / path).exists():
            errors.append(f"{rel}: `{span}`: no such path")
    for path in BARE.findall(CODE.sub("", text)):
        if not (ROOT / path).exists():
            errors.append(f"{rel}: {path}: no such path")
    return errors


def main() -> int:
    errors = [e for md in markdown_files() for e in check(md)]
    print("\n".join(errors) or f"links: {len(markdown_files())} files, all links and paths exist")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
