"""Every relative link in the README and docs/ names a file that exists and, with a #fragment, a heading of that file
(GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, -1, -2, ... for repeated headings)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md"))


def _anchors(path: pathlib.Path) -> set[str]:
  seen: dict[str, int] = {}
  out = set()
  in_code = False
  for line in path.read_text().splitlines():
    if line.startswith("```"):
      in_code = not in_code
    m = None if in_code else re.match(r"^#+\s+(.*)$", line)
    if m:
      slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def test_relative_links_and_anchors_resolve():
  assert DOCS, "no markdown files found"
  anchors = {p.resolve(): _anchors(p) for p in DOCS}
  bad = []
  for doc in DOCS:
    for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
      link = m.group(1)
      if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
        continue
      path, _, frag = link.partition("#")
      target = (doc.parent / path).resolve() if path else doc.resolve()
      if not target.exists():
        bad.append(f"{doc.relative_to(ROOT)}: {link}: no such file")
      elif frag and target in anchors and frag not in anchors[target]:
        bad.append(f"{doc.relative_to(ROOT)}: {link}: no such heading")
  assert not bad, "\n".join(bad)
