"""RESULTS.md sections regenerated on their own (§6–§9): one section replaced in the whole report, or read from it."""

from __future__ import annotations


def splice_section(report: str, header: str, lines: list[str]) -> str:
    """``report`` with the section that starts with ``header`` replaced by ``lines`` (up to the next ``## `` or the
    closing run summary, ``---``), or ``lines`` inserted before that summary when the section is not there yet."""
    body = "\n".join(lines)
    text = report.splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith(header)), None)
    if start is not None:
        end = next((i for i in range(start + 1, len(text)) if text[i].startswith("## ") or text[i] == "---"), len(text))
        return "\n".join([*text[:start], body, "", *text[end:]]).rstrip("\n") + "\n"
    footer = next((i for i, line in enumerate(text) if line == "---"), len(text))
    return "\n".join([*text[:footer], body, "", *text[footer:]]).rstrip("\n") + "\n"


def extract_section(report: str, header: str) -> list[str]:
    """The lines of the section of ``report`` that starts with ``header`` (empty if it has none), without its trailing
    blank lines (:func:`splice_section` adds one back): what a full ``benchmarks.reproduce`` run keeps."""
    text = report.splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith(header)), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(text)) if text[i].startswith("## ") or text[i] == "---"), len(text))
    while end > start and not text[end - 1]:
        end -= 1
    return text[start:end]
