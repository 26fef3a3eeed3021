"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page is the README itself, one text
rather than two copies, its links rewritten for the site — `docs/PAGE` is `PAGE` there, a
file of the checkout that the site publishes (LICENSE, as LICENSE.txt: a browser shows it
rather than downloading it) is linked there, and a link to any other file outside docs/
keeps only its text."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PUBLISHED = {"LICENSE": "LICENSE.txt"}  # a file of the checkout -> its name on the site
LINK = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")


def on_files(files, config):
    for source, name in PUBLISHED.items():
        files.append(File.generated(config, name, abs_src_path=str(ROOT / source)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    docs = Path(config["docs_dir"])

    def for_the_site(link: re.Match) -> str:
        text, target = link.groups()
        target = PUBLISHED.get(target, target.removeprefix("docs/"))
        published = target in PUBLISHED.values()
        if published or target.startswith(("http://", "https://")) or (docs / target.split("#")[0]).is_file():
            return f"[{text}]({target})"
        return text

    return LINK.sub(for_the_site, README.read_text())
