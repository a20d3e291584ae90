"""Check the documentation's links: every relative Markdown link (and its #anchor) and every
repository path written in backticks or in the text (`docs/...`, `crates/...`, `scripts/...`, `configs/...`,
`examples/...`) in README.md, docs/ and examples/ must exist. Also the shape issue 48 asks for: the
README within 200 lines, its opening within 80 words, no commit hash in its first 60 lines, and no
guide (docs/*.md but the design) over 400 lines. Prints each failure, exits 1 if any.

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


def shape() -> list[str]:
    errors = []
    readme = (ROOT / "README.md").read_text().splitlines()
    if len(readme) > 200:
        errors.append(f"README.md: {len(readme)} lines, more than 200")
    opening = " ".join(readme[1 : next(i for i, line in enumerate(readme) if line.startswith("!["))])
    if len(opening.split()) > 80:
        errors.append(f"README.md: its opening is {len(opening.split())} words, more than 80")
    for i, line in enumerate(readme[:60], 1):
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", line):
            if re.search(r"[a-f]", word) and re.search(r"[0-9]", word):
                errors.append(f"README.md:{i}: a commit hash ({word}) in the first 60 lines")
    for guide in sorted((ROOT / "docs").glob("*.md")):
        n = len(guide.read_text().splitlines())
        if guide.name != "design.md" and n > 400:
            errors.append(f"docs/{guide.name}: {n} lines, more than 400 for a guide")
    return errors


def main() -> int:
    errors = [e for md in markdown_files() for e in check(md)] + shape()
    print("\n".join(errors) or f"links: {len(markdown_files())} files, all links and paths exist")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
