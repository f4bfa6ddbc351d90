#!/usr/bin/env python3
"""The README stays short and plain (issue 52): at most 150 lines, and no sentence over 40 words.

Prose is split into sentences at `.`, `!` or `?` followed by a space; a paragraph, a list item, a
heading and each table cell are separate texts. Code blocks (fenced or indented), HTML comments and
table separator rows are skipped. Links count their text only, not their URL. A word is a
whitespace-separated token with a letter or a digit in it.

    readme_style.py REPO
"""
import re
import sys

MAX_LINES = 150
MAX_WORDS = 40


def texts(lines):
    """(line number, text) for each paragraph, list item, heading and table cell outside code."""
    out, para, start, fence = [], [], 0, None

    def flush():
        nonlocal para
        if para:
            out.append((start, " ".join(para)))
        para = []

    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        m = re.match(r"(`{3,}|~{3,})", stripped)
        if fence:
            if m and stripped.startswith(fence):
                fence = None
            continue
        if m:
            flush()
            fence = m.group(1)
            continue
        if not stripped:
            flush()
            continue
        if re.match(r"( {4}|\t)", line) and not para:  # an indented code block
            continue
        if stripped.startswith("|"):
            flush()
            if re.fullmatch(r"\|?(\s*:?-+:?\s*\|)*\s*:?-+:?\s*\|?", stripped):
                continue  # the separator row
            for cell in re.split(r"(?<!\\)\|", stripped.strip("|")):
                if cell.strip():
                    out.append((n, cell.strip()))
            continue
        if stripped.startswith("#"):
            flush()
            out.append((n, stripped.lstrip("#").strip()))
            continue
        if re.match(r"([-*+]|\d+[.)])\s", stripped):  # a list item starts a new text
            flush()
        if not para:
            start = n
        para.append(stripped)
    flush()
    return out


def plain(text):
    text = re.sub(r"<!--.*?-->", " ", text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](url) -> text
    text = re.sub(r"<(https?|mailto):[^>]*>", " ", text)  # <url>
    return text


def sentences(text):
    return [s for s in re.split(r"(?<=[.!?])\s+", plain(text)) if s.strip()]


def words(sentence):
    return [w for w in sentence.split() if re.search(r"\w", w)]


def main():
    repo = sys.argv[1]
    lines = open(f"{repo}/README.md", encoding="utf-8").read().splitlines()
    failed = []
    if len(lines) > MAX_LINES:
        failed.append(f"README.md has {len(lines)} lines, more than {MAX_LINES}")
    longest = (0, "")
    for n, text in texts(lines):
        for s in sentences(text):
            count = len(words(s))
            longest = max(longest, (count, s))
            if count > MAX_WORDS:
                failed.append(f"README.md:{n}: a sentence of {count} words (at most {MAX_WORDS}): {s}")
    if failed:
        sys.exit("\n".join(failed))
    print(f"ok: README.md has {len(lines)} lines; its longest sentence has {longest[0]} words: {longest[1]}")


if __name__ == "__main__":
    main()
