"""What every bench shares for reporting its timings: a distribution's summary (mean and percentiles), a
median, aligned text tables, and writing a result as JSON.

Percentiles interpolate linearly between the two nearest samples (numpy's default, as vLLM's and SGLang's
serving benches do), so ``p50 <= p90 <= p99`` always holds; an empty sample gives NaN everywhere.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


def distribution(values: Iterable[float]) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (NaN for each when there are none)."""
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return {"mean": math.nan, **{f"p{q}": math.nan for q in PERCENTILES}}
    return {"mean": float(array.mean()), **{f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES}}


def median(values: Iterable[float]) -> float:
    array = np.asarray(list(values), dtype=np.float64)
    return float(np.median(array)) if array.size else math.nan


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns right-aligned to their widest cell, the first left-aligned; floats with 2 decimals (1 past 100)."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}"
        return str(value)

    cells = [[cell(v) for v in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [" ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]  # fmt: skip
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def save_json(path: str | Path, result: dict) -> None:
    """``result`` as indented JSON, which has neither NaN nor infinity: NaN (no sample) becomes null and an
    infinite value (a request rate of "all at once") the string "inf"."""

    def clean(value: object) -> object:
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    Path(path).write_text(json.dumps(clean(result), indent=2) + "\n")
