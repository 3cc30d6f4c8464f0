"""Report writers shared by every eval and benchmark: one table of rows -> NAME.json, NAME.md and NAME.png.

Rows are flat dicts in "long" form (one measurement per row, e.g. {"metric": "bleu", "target": "base", "value": 12.3}
or {"target": "a", "concurrency": 8, "tok_s": 950.0}); the chart is a bar chart of one numeric column, with one bar
per row or, given a group column, bars grouped by x and coloured by group. Files are written into a temporary
directory inside OUT_DIR and renamed into place, so a failure never leaves a half-written report behind.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Chart = tuple[str, str, str | None]


def write_report(
    out_dir: str | os.PathLike,
    name: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str,
    chart: Chart | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Write OUT_DIR/NAME.{json,md[,png]} and return their paths by suffix.

    meta: anything JSON-serialisable stored beside the rows in the JSON (run configuration, raw outputs); its
    scalar entries are also listed in the Markdown. chart: (x_key, y_key, group_key or None), see module doc.
    """
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"report name {name!r}: expected a plain file stem such as 'eval_adapter'")
    rows = [dict(r) for r in rows]
    if chart is not None:
        _check_chart(rows, chart)
    document = {"title": title, "rows": rows, **(meta or {})}
    try:  # before any file exists
        payload = json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"report {name!r}: rows and meta must be JSON values without NaN/inf ({e})") from None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out))
    try:
        files = {"json": staging / f"{name}.json", "md": staging / f"{name}.md"}
        files["json"].write_text(payload + "\n")
        files["md"].write_text(markdown(title, rows, meta))
        if chart is not None:
            files["png"] = staging / f"{name}.png"
            _bar_chart(files["png"], title, rows, chart)
        paths = {}
        for kind, tmp in files.items():
            paths[kind] = out / tmp.name
            os.replace(tmp, paths[kind])
        return paths
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def markdown(title: str, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> str:
    """A '# title' heading, the scalar meta entries as a list, then the rows as one table (columns in the order
    they first appear)."""
    lines = [f"# {title}", ""]
    scalars = [(k, v) for k, v in (meta or {}).items() if isinstance(v, (str, int, float, bool)) or v is None]
    if scalars:
        lines += [f"- {k}: {_cell(v)}" for k, v in scalars] + [""]
    if rows:
        lines.append(markdown_table(rows))
    return "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as one Markdown table, columns in the order they first appear (what benchmarks print)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    if isinstance(value, (list, tuple, dict)):
        value = json.dumps(value, ensure_ascii=False)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _check_chart(rows: list[dict], chart: Chart) -> None:
    x_key, y_key, group_key = chart
    for i, row in enumerate(rows):
        for key in (x_key, y_key) + ((group_key,) if group_key else ()):
            if key not in row:
                raise ValueError(f"chart column {key!r} missing from row {i} (columns: {', '.join(row)})")
        y = row[y_key]
        if isinstance(y, bool) or not isinstance(y, (int, float)) or not math.isfinite(y):
            raise ValueError(f"chart column {y_key!r} in row {i}: expected a finite number, got {y!r}")


def _bar_chart(path: Path, title: str, rows: list[dict], chart: Chart) -> None:
    # Figure + Agg canvas directly: no pyplot, so no global backend state to fight with callers.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x_key, y_key, group_key = chart
    categories = list(dict.fromkeys(str(r[x_key]) for r in rows))
    groups = list(dict.fromkeys(str(r[group_key]) for r in rows)) if group_key else [None]
    width = 0.8 / len(groups)

    fig = Figure(figsize=(max(6.0, 0.9 * len(categories) * len(groups) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for gi, group in enumerate(groups):
        members = [r for r in rows if group is None or str(r[group_key]) == group]
        xs = [categories.index(str(r[x_key])) + (gi - (len(groups) - 1) / 2) * width for r in members]
        bars = ax.bar(xs, [r[y_key] for r in members], width=width, label=group)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_xlabel(x_key)
    ax.set_ylabel(y_key)
    ax.set_title(title)
    if group_key:
        ax.legend(title=group_key)
    fig.savefig(path, format="png", dpi=100)
