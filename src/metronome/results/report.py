"""The one writer of a bench's report: its result (the dict its JSON holds) as markdown, and
its plots as PNGs beside it. A bench declares what to show (`Report`: a title, tables and
plots, each naming where its rows are in the result); every number and label comes from the
result, so a report says nothing its run did not measure.

    REPORT = Report("Resume", tables=(Table("Latency", "resumes", (("where", "name", ""),
                                                                   ("p50 ms", "p50_ms", ".1f"))),),
                    plots=(Plot("{stem}.png", "rounds", x="round", ys=("ms",), series="arm"),))
    result = REPORT.finish(ctx, result)   # in `run`: draws the plots, listed in the result
    report = REPORT.markdown              # the module's `report(result) -> str`

The report's first lines are the provenance (machine, dtype, engine path, commit), the
command and its size; then the bench's one derived number (`derived(label, value)` in the
result), its knobs (the result's `config`), its tables and its figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.results.provenance import describe
from metronome.results.tables import md_table

Column = tuple[str, str, str]  # header, key in the row ("a.b": nested), format spec ("": str)


def derived(label: str, value) -> dict:
    """The bench's one derived number, as its result holds it."""
    return {"label": label, "value": value}


def get(obj, path: str):
    """`obj`'s value at a dotted path ("virtual.bounded.history", "rows.0.ms"); None if absent."""
    for part in path.split("."):
        try:
            obj = obj[int(part)] if isinstance(obj, list) else obj[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return obj


def cell(value, spec: str = "") -> str:
    """A table cell: '-' for None (not measured), yes/no, lists joined, numbers by `spec`."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(cell(v, spec) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {cell(v, spec)}" for k, v in value.items())
    if isinstance(value, float) and not spec:
        spec = ".4g"
    return format(value, spec) if spec and isinstance(value, int | float) else str(value)


def _rows(result: dict, path: str, where: tuple) -> list[dict]:
    rows = get(result, path) or []
    rows = [rows] if isinstance(rows, dict) else rows  # a dict: one row
    return [r for r in rows if all(get(r, k) == v for k, v in where)]


@dataclass(frozen=True)
class Table:
    title: str
    rows: str  # where the rows (a list of dicts, or one dict) are in the result
    columns: tuple[Column, ...] = ()  # none: the first row's keys (longer lists: in the JSON)
    where: tuple[tuple[str, object], ...] = ()  # only the rows with these values

    def markdown(self, result: dict) -> str:
        rows = _rows(result, self.rows, self.where)
        if not rows:
            return f"## {self.title}\n\n(not measured in this run)\n"
        columns = self.columns or tuple((key, key, "") for key, value in rows[0].items()
                                        if not isinstance(value, list) or len(value) <= 4)
        return f"## {self.title}\n\n" + md_table(
            [h for h, _, _ in columns],
            [[cell(get(r, key), spec) for _, key, spec in columns] for r in rows]) + "\n"


@dataclass(frozen=True)
class Plot:
    name: str  # the PNG's file name, beside the report ("{stem}": the JSON's)
    rows: str
    x: str
    ys: tuple[str, ...]  # one panel each
    series: str | None = None  # one line per value of this key
    where: tuple[tuple[str, object], ...] = ()

    def draw(self, ctx, result: dict) -> None:
        rows = _rows(result, self.rows, self.where)
        if not rows:
            return
        plt, save = ctx.figure(self.name.format(stem=ctx.out_json.stem))
        fig, axes = plt.subplots(len(self.ys), 1, figsize=(8, 2.2 + 2 * len(self.ys)),
                                 sharex=True, squeeze=False)
        names = list(dict.fromkeys(get(r, self.series) for r in rows)) if self.series else [None]
        for ax, y in zip(axes[:, 0], self.ys, strict=True):
            for name in names:
                mine = [r for r in rows if self.series is None or get(r, self.series) == name]
                points = [(get(r, self.x), get(r, y)) for r in mine
                          if get(r, self.x) is not None and get(r, y) is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), marker="." if len(points) > 30 else "o",
                            label=None if name is None else str(name))
            ax.set_ylabel(y)
            ax.grid(alpha=0.3)
            if self.series:
                ax.legend(fontsize=7)
        axes[-1, 0].set_xlabel(self.x)
        save(fig)


@dataclass(frozen=True)
class Report:
    title: str
    tables: tuple[Table, ...] = ()
    plots: tuple[Plot, ...] = ()
    spec: str = ".3g"  # the derived number's format

    def finish(self, ctx, result: dict) -> dict:
        """Draw the plots (each listed in the result's `plots`); the result, unchanged."""
        for plot in self.plots:
            plot.draw(ctx, result)
        return result

    def markdown(self, result: dict) -> str:
        found = result.get("derived") or {}
        knobs = ", ".join(f"`{k}` {cell(v)}" for k, v in (result.get("config") or {}).items())
        lines = [f"# {self.title}", "", describe(result["provenance"]), "",
                 f"Command: `{result['command']}` ({result['scale']} size, "
                 f"{result['elapsed_s']:.0f} s). Written by the command; do not edit by hand.",
                 ""]
        if found:
            lines += [f"**{found['label']}: {cell(found['value'], self.spec)}**", ""]
        if knobs:
            lines += [f"Knobs: {knobs}.", ""]
        lines += [t.markdown(result) for t in self.tables]
        lines += [f"![{name}]({name})\n" for name in result.get("plots", [])]
        return "\n".join(lines)
