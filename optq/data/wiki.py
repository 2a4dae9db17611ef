"""MediaWiki XML dump -> plain article text (used for the ``enwiki`` corpus).

The cleaning aims at WikiText-like prose: templates, tables, references, files, categories,
html tags and formatting quotes go; link texts stay; headings become plain lines. It is a
handful of regular expressions, not a wikitext parser, and it is deterministic.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator

__all__ = ["strip_wiki_markup", "iter_articles", "dump_to_text"]

_FLAGS = re.IGNORECASE | re.DOTALL
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_REF_PAIR = re.compile(r"<ref\b[^>/]*(?:/(?!>)[^>/]*)*>.*?</ref\s*>", _FLAGS)
_REF_SINGLE = re.compile(r"<ref\b[^>]*/>", _FLAGS)
# Tags whose content is not prose either (formulas, galleries, source listings...).
_DROP_BLOCKS = re.compile(
    r"<(math|gallery|timeline|syntaxhighlight|source|score|imagemap|references)\b[^>]*>.*?</\1\s*>", _FLAGS
)
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")  # innermost only; applied until nothing changes
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.DOTALL)  # innermost table
# [[File:...]] and friends may nest links inside their caption: remove innermost-first.
_NON_ARTICLE_LINK = re.compile(
    r"\[\[\s*(?:file|image|media|category|[a-z]{2,3}(?:-[a-z]+)?)\s*:[^\[\]]*\]\]", re.IGNORECASE
)
_LINK = re.compile(
    r"\[\[(?!\s*(?:file|image|media|category|[a-z]{2,3}(?:-[a-z]+)?)\s*:)([^\[\]|]*)(?:\|([^\[\]]*))?\]\]",
    re.IGNORECASE,
)
_EXT_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+(?:\s+([^\]]*))?\]")
_TAG = re.compile(r"</?[a-zA-Z][^<>]*?/?>")
_QUOTES = re.compile(r"'{2,}")
_HEADING = re.compile(r"^[ \t]*(=+)[ \t]*(.*?)[ \t]*\1[ \t]*$", re.MULTILINE)
_LIST_MARK = re.compile(r"^[*#:;]+\s*", re.MULTILINE)
_MAGIC = re.compile(r"__[A-Z]+__")
_BLANKS = re.compile(r"\n{3,}")
_SPACES = re.compile(r"[ \t\u00a0]+")


def _repeat(pattern: re.Pattern[str], repl: str, text: str) -> str:
    """Apply ``pattern`` until the text stops changing (peels nested structures inside out)."""
    while True:
        text, n = pattern.subn(repl, text)
        if n == 0:
            return text


def strip_wiki_markup(wikitext: str) -> str:
    """Turn the wikitext of one article (already XML-unescaped) into plain text."""
    text = _COMMENT.sub("", wikitext)
    text = _REF_SINGLE.sub("", text)
    text = _REF_PAIR.sub("", text)
    text = _DROP_BLOCKS.sub("", text)
    text = _repeat(_TEMPLATE, "", text)
    text = _repeat(_TABLE, "", text)
    # Alternate: plain links inside a file caption must become text before the caption's
    # own [[File:...]] has no brackets inside and can be removed.
    while True:
        before = text
        text = _NON_ARTICLE_LINK.sub("", text)
        text = _LINK.sub(lambda m: m.group(2) if m.group(2) is not None else m.group(1), text)
        if text == before:
            break
    text = _EXT_LINK.sub(lambda m: m.group(1) or "", text)
    text = _TAG.sub("", text)
    # Entities such as &nbsp; survive XML unescaping as text; resolve them after tags are gone.
    text = html.unescape(text)
    text = _QUOTES.sub("", text)
    text = _MAGIC.sub("", text)
    text = _HEADING.sub(lambda m: m.group(2), text)
    text = _LIST_MARK.sub("", text)
    lines = []
    for line in text.split("\n"):
        line = _SPACES.sub(" ", line).strip()
        # Leftovers of broken templates/tables are lines of pure punctuation: drop them.
        if line and not any(ch.isalnum() for ch in line):
            continue
        lines.append(line)
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def iter_articles(xml_text: str | bytes) -> Iterator[tuple[str, str]]:
    """Yield ``(title, wikitext)`` of each main-namespace, non-redirect page of a dump."""
    root = ET.fromstring(xml_text)
    ns = root.tag.split("}")[0] + "}" if root.tag.startswith("{") else ""
    for page in root.iter(f"{ns}page"):
        if (page.findtext(f"{ns}ns") or "0").strip() != "0":
            continue
        if page.find(f"{ns}redirect") is not None:
            continue
        title = page.findtext(f"{ns}title") or ""
        body = page.findtext(f"{ns}revision/{ns}text") or ""
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        yield title.strip(), body


def dump_to_text(xml_text: str | bytes) -> str:
    """All articles of a dump as plain text: each starts with its title line, blank-line separated."""
    parts = []
    for title, body in iter_articles(xml_text):
        plain = strip_wiki_markup(body)
        if plain:
            parts.append(f"{title}\n\n{plain}")
    return "\n\n".join(parts) + "\n"
