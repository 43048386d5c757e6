"""The few HTML pieces the report is made of; every number goes through `figure`.

`figure` prints a value and names where it came from in `data-from`: a run or data file and a JSON pointer
(RFC 6901) into it, e.g. `evaluation.json#/per_class/normal/roc_auc`; `csv-count:dropped.csv#reason=...` for a
count of table rows; `count:` for a list's length, `sum:train_log.json#/epochs/*/seconds` for a total,
`scale:1e-6:` for a unit change (bytes as MB). tests/test_report.py resolves every one
against the file and checks the printed text, so the report cannot show a number its files do not hold.
Everything else is escaped text; no script, no external resource, so the page reads offline and prints.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable
from typing import Any

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; max-width: 1050px; margin: 1.5em auto; padding: 0 1em; color: #111; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #345; margin-top: 1.6em; }
h3 { margin: 1.1em 0 0.3em; }
table { border-collapse: collapse; margin: 0.4em 0 0.8em; } th, td { border: 1px solid #bbb; padding: 2px 7px; }
th { background: #eef1f4; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.missing { background: #fff4d6; border-left: 4px solid #d9a400; padding: 4px 8px; }
.warning { background: #fde8e8; border-left: 4px solid #c0392b; padding: 4px 8px; }
.note { color: #444; font-size: 0.92em; }
.figures img { max-width: 32%; vertical-align: top; margin: 0 0.5% 0.5em 0; }
.examples { display: flex; flex-wrap: wrap; gap: 10px; }
.example { border: 1px solid #bbb; padding: 4px; width: 250px; font-size: 0.9em; }
.example img { width: 120px; image-rendering: pixelated; }
.curves svg { margin: 0 4px 4px 0; }
code { font-size: 0.92em; }
@media print { body { max-width: none; margin: 0; } h2 { break-after: avoid; } .example, table, img { break-inside: avoid; } }
"""


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def pointer(*parts: Any) -> str:
    """A JSON pointer from keys and indices (`~` and `/` escaped as RFC 6901 says)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def ref(file: str, *parts: Any) -> str:
    """`file#/json/pointer`: where a figure comes from."""
    return f"{file}#{pointer(*parts)}"


def number(value: Any, fmt: str = ".3f") -> str:
    """How a figure is printed: an integer (a count) as it is, a real number with `fmt`; None as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    return format(float(value), fmt)


def figure(value: Any, source: str, fmt: str = ".3f") -> str:
    """`value` as printed text, tagged with the file (and pointer) it was read from and the format it was printed in."""
    return f'<span class="fig" data-from="{esc(source)}" data-format="{fmt}">{esc(number(value, fmt))}</span>'


def text_from(value: Any, source: str) -> str:
    """A text value (a class name, a path, a hash) tagged with where it came from."""
    return f'<span class="txt" data-from="{esc(source)}">{esc(value)}</span>'


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], numeric_from: int = 1) -> str:
    """Cells are HTML already (escape text with `esc`, numbers with `figure`); columns from `numeric_from` right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{cell}</td>' if i >= numeric_from else f"<td>{cell}</td>" for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def png(data: bytes, alt: str, css: str = "") -> str:
    encoded = base64.b64encode(data).decode("ascii")
    css_class = f' class="{css}"' if css else ""
    return f'<img{css_class} alt="{esc(alt)}" src="data:image/png;base64,{encoded}">'


def missing(what: str, why: str) -> str:
    return f'<p class="missing"><b>Missing:</b> {esc(what)}. {esc(why)}</p>'


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{esc(title)}</h2>{body}</section>'


def page(title: str, header: str, sections: list[str]) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>"
        f"{header}{''.join(sections)}</body></html>\n"
    )
