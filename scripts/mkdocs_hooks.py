"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page is the README itself, one text
rather than two copies, its links rewritten for the site — `docs/PAGE` is `PAGE` there, and a
link to a file outside docs/ (LICENSE) keeps only its text."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
LINK = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    docs = Path(config["docs_dir"])

    def for_the_site(link: re.Match) -> str:
        text, target = link.groups()
        target = target.removeprefix("docs/")
        if target.startswith(("http://", "https://")) or (target and (docs / target.split("#")[0]).is_file()):
            return f"[{text}]({target})"
        return text

    return LINK.sub(for_the_site, README.read_text())
