"""The documentation stays true to the repository: the configuration
reference is what scripts/gen_config_docs.py writes from the config Structs,
the README stays short, every relative link points at a file that exists,
and nothing cites a file outside the repository. Fast: no engine, no torch."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_reference_is_generated_from_the_structs():
    want = _generator().render()
    have = (DOCS / "configuration.md").read_text()
    assert have == want, ("docs/configuration.md differs from the config Structs' declarations: "
                          "run `python scripts/gen_config_docs.py` and commit the result")


def test_every_config_key_is_in_the_reference():
    from msgspec import inspect as mi

    from rlnode.config import Config

    text = (DOCS / "configuration.md").read_text()

    def keys(st, prefix):
        for f in st.fields:
            t = f.type
            if isinstance(t, mi.StructType):
                yield from keys(t, f"{prefix}{f.encode_name}.")
            else:
                yield f"{prefix}{f.encode_name}"
                if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.StructType):
                    yield from keys(t.item_type, f"{prefix}{f.encode_name}[i].")

    missing = [k for k in keys(mi.type_info(Config), "") if f"`{k}`" not in text]
    assert missing == []
    assert "`trainer.loss.dual_clip` · float, >= 0 · default `3.0`" in text


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page, and explicit ids."""
    text = page.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", ROOT / "examples" / "README.md", *DOCS.rglob("*.md")]:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert broken == []


# Built from parts so that this file does not match itself.
_OUTSIDE = [re.compile(p) for p in ("DESIGN " + "§", r"\.\./" + "shared", "shared/" + "DESIGN", "shared/" + "gpu/")]
_SCANNED = ("rlnode", "tests", "scripts", "conf", "examples", "systemd", "docs")
_SUFFIXES = {".py", ".sh", ".toml", ".md", ".service", ".target", ".example", ".cfg", ".txt", ".jinja", ".html"}


def test_nothing_cites_a_file_outside_the_repository():
    files = [ROOT / "Makefile", ROOT / "README.md", ROOT / "pyproject.toml", ROOT / ".importlinter"]
    for top in _SCANNED:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in _SUFFIXES
                  and "__pycache__" not in p.parts]
    hits = []
    for path in files:
        rel = path.relative_to(ROOT)
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pat in _OUTSIDE:
                # docs/design/ keeps the old section numbers ("§8") findable.
                if pat.search(line) and not (rel.parts[0] == "docs" and pat.pattern.startswith("DESIGN")):
                    hits.append(f"{rel}:{n}: {line.strip()}")
    assert hits == [], "cite docs/design/ (inside the repository) instead:\n" + "\n".join(hits)
