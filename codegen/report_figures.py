"""The report's two pictures: report/comparison.svg (this plan against each baseline) and
report/schedule.svg (the simulated iteration, one row per function lane).

They are SVG drawn with matplotlib (no pyplot state) under fixed settings so that the same plan and
timeline always give the same bytes: a fixed hash salt for the SVG ids, no date or creator metadata,
text kept as text in one font, and numbers formatted to a fixed number of significant digits. What a
later matplotlib release may still change (ids, tick choices, text placement, number printing)
`svg_summary` leaves out: golden tests compare pictures through it.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import matplotlib
import matplotlib.style
from matplotlib.figure import Figure
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path

from ..ir.plan import Figures, TrainingPlan
from ..ir.timeline import LANES, Span, Timeline
from .numbers import fmt, fmt_s

#: at most this many replicas of a stage get rows in the schedule...
MAX_REPLICAS_SHOWN = 8
#: ...and fewer when there are many stages, so the chart keeps about this many functions (3 rows each)
MAX_FUNCTIONS_SHOWN = 32

# Span kind -> legend group; kinds not listed fall into a grey group named after the kind.
_GROUPS = {
    "forward": "forward",
    "backward": "backward",
    "recv-activation": "activation transfer",
    "send-activation": "activation transfer",
    "recv-gradient": "gradient transfer",
    "send-gradient": "gradient transfer",
    "sync-scatter": "sync scatter-reduce",
    "sync-gather": "sync gather",
    "update": "optimizer update",
}
_COLOURS = {
    "forward": "#3b6fb6",
    "backward": "#e8833a",
    "activation transfer": "#a6c8ea",
    "gradient transfer": "#f6c08f",
    "sync scatter-reduce": "#7dc98f",
    "sync gather": "#2f8f4e",
    "optimizer update": "#b4477a",
}
_OTHER_COLOUR = "#9a9a9a"
_PLAN_COLOUR = "#3b6fb6"
_BASELINE_COLOUR = "#b8b8b8"

# Fixed rendering settings (see the module docstring); applied over matplotlib's defaults so that a
# user's matplotlibrc cannot change the bytes.
_RC = {
    "svg.hashsalt": "cloudless-report",
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "figure.dpi": 72,
    "savefig.dpi": 72,
}
# Only these SVG metadata keys would vary between runs or versions; None leaves them out.
_SVG_METADATA = {"Date": None, "Creator": None}

# Schedule layout, in inches (72 points each).
_GANTT_WIDTH = 11.0
_GANTT_LEFT, _GANTT_RIGHT, _GANTT_TOP, _GANTT_BOTTOM = 1.3, 0.25, 0.55, 0.75
_ROW_HEIGHT = 0.16
_BAR_HEIGHT = 0.8  # of a row
_LABEL_FONT = 5.5  # points, micro-batch numbers inside compute spans
_MERGE_GAP_PT = 0.5  # spans closer than this on one row touch on the picture
_MIN_SPLIT_PT = 2.0  # narrower touching spans of one group are drawn as one bar
_SEPARATOR_PT = 0.4  # blank at the end of each bar, so touching bars stay apart
_RECT_CODES = [Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY]


@contextmanager
def fixed_style() -> Iterator[None]:
    """matplotlib's defaults plus _RC, for building and saving a figure (fonts are read at both)."""
    with ExitStack() as stack:
        stack.enter_context(matplotlib.style.context("default"))
        stack.enter_context(matplotlib.rc_context(_RC))  # type: ignore[arg-type]  # stubs want literal keys
        yield


def svg_bytes(build: Callable[..., Figure], *args: Any) -> bytes:
    """The SVG of the figure `build(*args)` returns, drawn under the fixed style."""
    with fixed_style():
        figure: Figure = build(*args)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="svg", metadata=_SVG_METADATA)
    return buffer.getvalue()


# --- what a picture shows, for comparisons --------------------------------------------------------

_SVG_NS = "{http://www.w3.org/2000/svg}"
#: ids the report gives its own shapes (bars of the comparison, span groups of the schedule)
_OWN_SHAPES = ("bar-", "spans-")
_NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:e-?\d+)?")
#: an axis's offset text ("1e−6", "+1.5", "×10^{−6}"), which matplotlib's tick formatter chooses
_AXIS_OFFSET = re.compile(r"[-−+×.\de^{}$\\ ]+")


def svg_summary(svg: bytes, digits: int = 1) -> str:
    """What a report picture shows, one line per item, free of what a matplotlib release may change
    without changing the picture: the figure's size; every text in drawing order (titles, axis and
    legend labels, stage and lane names, figures and micro-batch numbers), except the x axis's tick
    labels and offset, which matplotlib's locator and formatter choose; and the report's own shapes (ids `bar-*`,
    `spans-*`) with their fill colour and outline, in points rounded to `digits` decimals. Ids,
    clip paths, marker definitions, metadata, styles of matplotlib's own elements and the positions
    of texts are left out. Golden tests compare this instead of the bytes."""
    root = ET.fromstring(svg)
    lines = [f"size {root.get('width')} x {root.get('height')}"]

    def visit(element: ET.Element, shape: str | None, x_axis: bool) -> None:
        gid = element.get("id") or ""
        if element.tag == f"{_SVG_NS}g" and gid.startswith("xtick_"):
            return  # matplotlib's own x ticks: their number, place and text follow its locator
        # An axis of matplotlib's whose ticks are x ticks.
        x_axis = x_axis or any((child.get("id") or "").startswith("xtick_") for child in element)
        if gid.startswith(_OWN_SHAPES):
            shape = gid
        if element.tag == f"{_SVG_NS}text":
            text = "".join(element.itertext())
            if not (x_axis and _AXIS_OFFSET.fullmatch(text)):
                lines.append("text " + text)
            return
        if element.tag == f"{_SVG_NS}path" and shape is not None:
            fill = re.search(r"fill:\s*([^;]+)", element.get("style") or "")
            outline = " ".join(
                f"{float(token):.{digits}f}" if _NUMBER.fullmatch(token) else token
                for token in re.findall(r"[A-Za-z]|" + _NUMBER.pattern, element.get("d") or "")
            )
            lines.append(f"shape {shape} fill {fill.group(1).strip() if fill else '-'}: {outline}")
        for child in element:
            visit(child, shape, x_axis)

    visit(root, None, False)
    return "\n".join(lines) + "\n"


# --- comparison.svg --------------------------------------------------------------------------------


def _feasible(plan: TrainingPlan) -> list[tuple[str, Figures]]:
    """(name, figures) of each baseline that has a plan."""
    return [(b.name, b.predicted) for b in plan.baselines if b.feasible and b.predicted is not None]


def comparison_figure(plan: TrainingPlan) -> Figure:
    """Time and cost per iteration, this plan against each feasible baseline, as two bar panels."""
    entries = [("this plan", plan.predicted.iteration_s, plan.predicted.cost_usd, True)]
    entries += [(name, figures.iteration_s, figures.cost_usd, False) for name, figures in _feasible(plan)]
    infeasible = [b.name for b in plan.baselines if not b.feasible]
    height = 1.3 + 0.4 * len(entries) + (0.25 if infeasible else 0.0)
    figure = Figure(figsize=(10.0, height))
    bottom = (0.55 + (0.25 if infeasible else 0.0)) / height
    figure.subplots_adjust(left=0.13, right=0.98, top=1 - 0.6 / height, bottom=bottom, wspace=0.45)
    axes = figure.subplots(1, 2)
    figure.suptitle(f"{plan.model}: this plan against the baselines (shorter is better)", fontsize=10)
    y = list(range(len(entries)))
    colours = [_PLAN_COLOUR if mine else _BASELINE_COLOUR for *_, mine in entries]
    panels = (
        (axes[0], [e[1] for e in entries], "Time per iteration", "s"),
        (axes[1], [e[2] for e in entries], "Cost per iteration", "USD"),
    )
    for ax, values, title, unit in panels:
        bars = ax.barh(y, values, height=0.6, color=colours)
        for i, bar in enumerate(bars):
            bar.set_gid(f"bar-{unit.lower()}-{i}")
        top = max(values) or 1.0
        ax.set_xlim(0, top * 1.3)
        for yi, value in zip(y, values, strict=True):
            ax.text(value + top * 0.01, yi, f"{fmt(value)} {unit}", va="center", ha="left", fontsize=7)
        ax.set_yticks(y, [e[0] for e in entries])
        ax.invert_yaxis()
        ax.set_title(f"{title} ({unit})")
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
        ax.get_yticklabels()[0].set_fontweight("bold")
    if infeasible:
        figure.text(0.01, 0.08 / height, "Not shown (no feasible plan): " + ", ".join(infeasible), fontsize=7)
    return figure


# --- schedule.svg ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One drawn rectangle: a span, or touching spans of one group merged; `label` is its micro-batch."""

    row: int
    start: float
    end: float
    group: str
    label: str | None


def group_of(kind: str) -> str:
    return _GROUPS.get(kind, kind)


def replicas_shown(plan: TrainingPlan) -> int:
    """How many replicas of each stage get rows (the first ones; replicas run alike, in turn)."""
    return max(1, min(MAX_REPLICAS_SHOWN, MAX_FUNCTIONS_SHOWN // max(1, len(plan.stages))))


def schedule_rows(plan: TrainingPlan) -> list[tuple[int, int, str]]:
    """(stage, replica, lane) of each row of the schedule, top to bottom."""
    cap = replicas_shown(plan)
    return [(s.index, j, lane) for s in plan.stages for j in range(min(cap, s.replicas)) for lane in LANES]


def _seconds_per_point(timeline: Timeline) -> float:
    width_pt = (_GANTT_WIDTH - _GANTT_LEFT - _GANTT_RIGHT) * 72
    return _x_limit(timeline) / width_pt


def _x_limit(timeline: Timeline) -> float:
    return timeline.iteration_s * 1.01 if timeline.iteration_s > 0 else 1.0


def schedule_bars(plan: TrainingPlan, timeline: Timeline) -> list[Bar]:
    """The bars the schedule draws, row by row. Touching spans of one group on one row merge when
    one of them is too narrow to see apart, and the pieces of a gradient sync always merge: this
    keeps the SVG small for large plans without changing what the picture shows."""
    rows = {key: i for i, key in enumerate(schedule_rows(plan))}
    per_row: dict[int, list[Span]] = {}
    for span in timeline.spans:
        row = rows.get((span.stage, span.replica, span.lane))
        if row is not None:
            per_row.setdefault(row, []).append(span)
    gap = _MERGE_GAP_PT * _seconds_per_point(timeline)
    narrow = _MIN_SPLIT_PT * _seconds_per_point(timeline)
    bars: list[Bar] = []
    for row in sorted(per_row):
        current: Bar | None = None
        for span in sorted(per_row[row], key=lambda s: (s.start, s.end, s.kind)):
            group = group_of(span.kind)
            label = None if span.micro_batch is None else str(span.micro_batch)
            touching = current is not None and current.group == group and span.start - current.end <= gap
            small = current is not None and min(current.end - current.start, span.end - span.start) < narrow
            if current is not None and touching and (small or span.kind.startswith("sync-")):
                current = Bar(row, current.start, max(current.end, span.end), group, None)
                continue
            if current is not None:
                bars.append(current)
            current = Bar(row, span.start, span.end, group, label)
        if current is not None:
            bars.append(current)
    return bars


def _gid(group: str) -> str:
    return "spans-" + re.sub(r"[^a-z0-9]+", "-", group.lower()).strip("-")


def schedule_figure(plan: TrainingPlan, timeline: Timeline) -> Figure:
    """The simulated iteration as a Gantt chart: a row per (stage, replica, lane), spans coloured by
    group, micro-batch numbers inside compute spans wide enough to hold them."""
    rows = schedule_rows(plan)
    bars = schedule_bars(plan, timeline)
    height = _GANTT_TOP + _GANTT_BOTTOM + _ROW_HEIGHT * max(len(rows), 3)
    figure = Figure(figsize=(_GANTT_WIDTH, height))
    figure.subplots_adjust(
        left=_GANTT_LEFT / _GANTT_WIDTH,
        right=1 - _GANTT_RIGHT / _GANTT_WIDTH,
        top=1 - _GANTT_TOP / height,
        bottom=_GANTT_BOTTOM / height,
    )
    ax = figure.add_subplot()
    cap = replicas_shown(plan)
    title = (
        f"{plan.model}: simulated iteration, {len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''}, "
        f"{plan.micro_batches} micro-batches "
        f"of {plan.micro_batch} ({plan.schedule}), {fmt_s(timeline.iteration_s)}"
    )
    if any(s.replicas > cap for s in plan.stages):
        title += f"; first {cap} replicas of each stage shown"
    ax.set_title(title, loc="left")

    half = _BAR_HEIGHT / 2
    # Touching spans (consecutive micro-batches) are told apart by a hairline gap cut from each bar's
    # end; cheaper in bytes than an edge stroke on every path.
    cut = _SEPARATOR_PT * _seconds_per_point(timeline)
    groups: dict[str, list[Bar]] = {}
    for bar in bars:
        groups.setdefault(bar.group, []).append(bar)
    order = [g for g in _COLOURS if g in groups] + sorted(g for g in groups if g not in _COLOURS)
    handles = []
    for group in order:
        colour = _COLOURS.get(group, _OTHER_COLOUR)
        vertices, codes = [], []
        for b in groups[group]:
            end = b.end - cut if b.end - b.start > 3 * cut else b.end
            top, bottom = b.row - half, b.row + half
            vertices += [(b.start, top), (end, top), (end, bottom), (b.start, bottom), (b.start, top)]
            codes += _RECT_CODES
        # One SVG path per group, a subpath per bar: a third of the bytes of one element per bar.
        path = Path(vertices, codes)
        path.should_simplify = False  # every bar must stay, however thin
        patch = PathPatch(path, facecolor=colour, edgecolor="none", linewidth=0, gid=_gid(group))
        patch.set_clip_on(False)  # every bar lies inside the axes
        ax.add_patch(patch)
        handles.append(Patch(facecolor=colour, label=group))

    per_point = _seconds_per_point(timeline)
    for bar in bars:
        if bar.label is None or bar.group not in ("forward", "backward"):
            continue
        needed = (0.62 * _LABEL_FONT * len(bar.label) + 2) * per_point
        if bar.end - bar.start >= needed:
            ax.text(
                (bar.start + bar.end) / 2,
                bar.row,
                bar.label,
                ha="center",
                va="center",
                fontsize=_LABEL_FONT,
                color="white" if bar.group == "forward" else "black",
            )

    ax.set_xlim(0, _x_limit(timeline))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    labels = [f"s{s} r{j}  {lane}" if lane == LANES[0] else lane for s, j, lane in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=6 if len(rows) > 48 else 7)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("seconds since the iteration started")
    ax.grid(axis="x", color="#e4e4e4", linewidth=0.5)
    ax.set_axisbelow(True)
    # Lines between functions, darker between stages.
    for i in range(3, len(rows), 3):
        new_stage = rows[i][0] != rows[i - 1][0]
        ax.axhline(i - 0.5, color="#707070" if new_stage else "#d0d0d0", linewidth=0.6 if new_stage else 0.4)
    figure.legend(
        handles=handles,
        loc="lower center",
        ncol=min(len(handles), 7) or 1,
        frameon=False,
        bbox_to_anchor=(0.5, 0.02 / height),
    )
    return figure
