#!/usr/bin/env python3
"""Keeps the docs at their jobs. No dependencies; run from anywhere: python3 scripts/check-docs.py

README.md (the front page: what the project is, the two commands, a tour, what runs where):
  - at most 300 lines and 20,000 bytes;
  - no dates (2026-11-26): figures and runs carry their dates in docs/benchmarks.md and
    docs/testing.md, not here;
  - no commit ids: a word of 7 to 40 hex digits with at least one digit and one letter a-f,
    outside fenced code blocks, inline code included (0x1b36, cafe, 0000:01:00.0, words of
    hex letters only, and hex runs inside longer identifiers pass);
  - no issue numbers ("issue 21", "issues 12", "#53"), outside fenced code blocks.
docs/benchmarks.md (one current table per benchmark; history in benches/results/history.md):
  - no section heading with a date in it;
  - no "Not yet understood" and no "Next:" (open questions and plans belong to the history).
README.md and docs/*.md:
  - every relative markdown link points to a file or folder that exists.

Prints each violation as FILE:LINE: what, and exits 1 on any.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = "README.md"
BENCHMARKS = os.path.join("docs", "benchmarks.md")
MAX_LINES = 300
MAX_BYTES = 20_000

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# A hex word of 7-40 characters, not part of a longer word, a 0x literal or a dotted/colon
# address (PCI addresses such as 0000:01:00.0 have no letters in practice; the look-arounds
# also keep identifiers such as sm_90a or abc-def-1234567 from matching in part).
HEX_WORD = re.compile(r"(?<![0-9A-Za-z_\-.:/#])([0-9a-f]{7,40})(?![0-9A-Za-z_\-])")
ISSUE = [
    re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    re.compile(r"(?<![&\w/#])#\d+\b"),
]
BENCH_FORBIDDEN = [re.compile(r"Not yet understood", re.IGNORECASE), re.compile(r"\bNext:")]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")

problems = []


def report(path, line, what):
    problems.append(f"{path}:{line}: {what}")


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def prose_lines(text):
    """(line number, line) for lines outside fenced code blocks, inline code's backticks
    turned into spaces (its text is still checked)."""
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        yield n, line.replace("`", " ")


def is_commit_id(word):
    return re.search(r"\d", word) and re.search(r"[a-f]", word)


def check_readme():
    text = read(README)
    raw = text.encode("utf-8")
    lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    if lines > MAX_LINES:
        report(README, lines, f"{lines} lines, at most {MAX_LINES}")
    if len(raw) > MAX_BYTES:
        report(README, lines, f"{len(raw)} bytes, at most {MAX_BYTES}")
    # Dates anywhere, code blocks included: a dated command line is a dated run.
    for n, line in enumerate(text.split("\n"), 1):
        for m in DATE.finditer(line):
            report(README, n, f"a date ({m.group(0)}): dates belong to docs/benchmarks.md or docs/testing.md")
    for n, line in prose_lines(text):
        for m in HEX_WORD.finditer(line):
            if is_commit_id(m.group(1)):
                report(README, n, f"a commit id ({m.group(1)}): name what changed, not the commit")
        for rx in ISSUE:
            for m in rx.finditer(line):
                report(README, n, f"an issue number ({m.group(0)}): say what it is about instead")


def check_benchmarks():
    for n, line in prose_lines(read(BENCHMARKS)):
        if line.startswith("#") and DATE.search(line):
            report(BENCHMARKS, n, "a date in a section heading: one current section per benchmark, "
                   "dates in its table (history: benches/results/history.md)")
        for rx in BENCH_FORBIDDEN:
            if rx.search(line):
                report(BENCHMARKS, n, f"'{rx.pattern}' text belongs to benches/results/history.md")


def check_links(rel):
    text = read(rel)
    base = os.path.dirname(os.path.join(ROOT, rel))
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "``", line)
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue  # http:, mailto:, in-page anchors
            path = target.split("#", 1)[0]
            if not path:
                continue
            if not os.path.exists(os.path.normpath(os.path.join(base, path))):
                report(rel, n, f"link to {target}: no such file")


def main():
    check_readme()
    check_benchmarks()
    docs = [README] + sorted(
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
    )
    for rel in docs:
        check_links(rel)
    for p in problems:
        print(p)
    if problems:
        print(f"check-docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check-docs: README.md, docs/benchmarks.md and the links of {len(docs)} files are fine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
