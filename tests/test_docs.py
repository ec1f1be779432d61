"""Docs that match the code: every repository path cited in code and docs exists, every
"docs/techniques.md section N" names a section that is there, and every Markdown link reaches its file and
heading."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A file of the repository: one of its top-level folders, more components, a file extension.
CITED_PATH = re.compile(r"(?<![\w/.~-])((?:light_jax|configs|docs|tests|benchmarks|scripts)/[\w/.-]*\.[a-z]+)\b")
SECTION = re.compile(r"docs/techniques\.md section (\d+)")


def _tracked_text_files():
  files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  return [f for f in files if f.endswith((".py", ".md", ".toml")) or os.path.basename(f) == "Makefile"]


def test_every_cited_repository_path_exists():
  missing = []
  for name in _tracked_text_files():
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      text = f.read()
    for match in CITED_PATH.finditer(text):
      path = match.group(1).rstrip(".")
      if not os.path.exists(os.path.join(ROOT, path)):
        missing.append(f"{name}: {path}")
  assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_cited_sections_of_techniques_md_exist():
  with open(os.path.join(ROOT, "docs", "techniques.md"), encoding="utf-8") as f:
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", f.read(), flags=re.MULTILINE)}
  cited = []
  for name in _tracked_text_files():
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      cited += [(name, int(n)) for n in SECTION.findall(f.read())]
  assert cited, "nothing cites docs/techniques.md by section"
  assert [c for c in cited if c[1] not in sections] == []


def _anchors(path: str) -> set[str]:
  """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
  with open(path, encoding="utf-8") as f:
    headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", f.read(), flags=re.S), flags=re.MULTILINE)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_markdown_links_reach_their_files_and_headings():
  broken = []
  for name in [f for f in _tracked_text_files() if f.endswith(".md")]:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code blocks hold commands, not links
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
      if link.startswith(("http://", "https://", "mailto:")):
        continue
      path, _, anchor = link.partition("#")
      target = os.path.normpath(os.path.join(ROOT, os.path.dirname(name), path)) if path else os.path.join(ROOT, name)
      if not os.path.exists(target):
        broken.append(f"{name}: {link} (no such file)")
      elif anchor and target.endswith(".md") and anchor not in _anchors(target):
        broken.append(f"{name}: {link} (no such heading)")
  assert not broken, "broken links:\n" + "\n".join(broken)
