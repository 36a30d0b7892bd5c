"""Run reports: a run folder with ``report.json`` and PNG plots a person can look at.

A run folder holds one ``report.json`` (written by `write_run`) and up to four plots
drawn from it alone (`draw_plots`), so that `redraw` can redo them later from the
folder without the model or the data:

- ``accuracy_vs_epsilon.png``: test (validation) accuracy against the epsilon spent,
  one point per epoch, with its Pareto front (the paper's Figure 3b);
- ``certified_accuracy.png``: certified accuracy against the L2 radius;
- ``gradient_norms.png``: histograms of exact per-example gradient norms against the
  bound the noise is calibrated to, one panel per variable (the paper's Figures 8-9);
- ``tightness.png``: max and mean of observed norm / bound per variable.

A plot whose data the report lacks is skipped (and a stale file of that name left by
an earlier drawing removed), never an error.

The report (``format_version`` 1) is a JSON object::

    {"format": "lipdp-run-report", "format_version": 1, "created": ISO 8601 UTC time,
     "config": the run's config dict, "versions": versions(), "seed": the data seed,
     "per_epoch": {"epoch": [1, 2, ...], "epsilon": [...], "val_accuracy": [...], ...},
     "results": the final results (epsilon, delta, test_accuracy, certified_accuracy
                {str(radius): fraction} or None, ...),
     "gradient_norms": {var: {"bound": b, "norms": [...]}} or null,
     "tightness": {var: {"bound", "max_ratio", "mean_ratio", "examples"}} or null,
     "audit": the privacy audit's summary or null}

Every number is a plain JSON number; a NaN or infinite value (a diverged loss) is
written as ``null``.

**Privacy.** ``accuracy`` and ``loss`` per epoch are computed on the training data
outside the noisy gradient, and so are the gradient norms and the tightness: none of
them is covered by epsilon (they are what the person who holds the data looks at).
Share ``epsilon``, ``val_*`` and the test results.

matplotlib is needed for the plots only (``pip install 'lipdp[reports]'``); it is
imported when a plot is drawn, and no pyplot state is touched (figures are drawn on
their own Agg canvas), so reports can be drawn from a notebook or a thread.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import importlib.metadata
import json
import math
import os
import platform
import tempfile
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["PLOT_FILES", "REPORT_FILE", "ReportError", "build_report", "draw_plots",
           "gradient_norm_sample", "read_report", "redraw", "tightness_from_norms",
           "versions", "write_run"]

REPORT_FILE = "report.json"
FORMAT = "lipdp-run-report"
FORMAT_VERSION = 1
# Per-epoch Keras logs kept in the report, in this order, when the history has them.
EPOCH_KEYS = ("epsilon", "val_accuracy", "accuracy", "loss", "val_loss")
# Plot name -> file, in drawing order.
PLOT_FILES = {"accuracy_vs_epsilon": "accuracy_vs_epsilon.png",
              "certified_accuracy": "certified_accuracy.png",
              "gradient_norms": "gradient_norms.png",
              "tightness": "tightness.png"}

# Distributions reported by `versions`: (label, candidate distribution names, always listed).
_PACKAGES = (
    ("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tensorflow-intel"), True),
    ("deel-lip", ("deel-lip",), True),
    ("autodp", ("autodp",), True),
    ("numpy", ("numpy",), True),
    ("kymatio", ("kymatio",), False),
    ("scikit-learn", ("scikit-learn",), False),
    ("matplotlib", ("matplotlib",), False),
)


class ReportError(ValueError):
    """A ``report.json`` that cannot be read as a lipdp run report."""


# --------------------------------------------------------------------------- #
# Contents.
# --------------------------------------------------------------------------- #
def _installed_version(candidates: Sequence[str]) -> Optional[str]:
    for name in candidates:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> Dict[str, Optional[str]]:
    """Versions of Python, lipdp and the libraries a run's numbers depend on.

    ``python``, ``lipdp``, ``tensorflow``, ``deel-lip``, ``autodp`` and ``numpy``
    always (None for one not installed); ``kymatio``, ``scikit-learn`` and
    ``matplotlib`` when installed. Read from the installed distributions' metadata,
    without importing them.
    """
    from lipdp import __version__

    found = {"python": platform.python_version(), "lipdp": __version__}
    for label, candidates, always in _PACKAGES:
        version = _installed_version(candidates)
        if version is not None or always:
            found[label] = version
    return found


def gradient_norm_sample(model, data, sample_size: int = 256, seed: int = 0, *,
                         chunk_size: int = 64) -> Optional[Dict[str, dict]]:
    """Exact per-example gradient norms of a sample, beside the bounds the step uses.

    For every trainable variable v and every example (x_i, y_i) of the sample, the exact
    ``||grad_v loss(f(x_i), y_i)||_2`` (`lipdp.per_example`, with the loss the model was
    compiled with) and ``bound(v)``, the per-example bound backpropagation for bounds
    gives at the current weights (`lipdp.bounds.gradient_bounds`; the train step divides
    it by its batch denominator and calibrates its noise to it). The invariant of lipdp
    is ``norm <= bound`` for every example (up to float32 rounding).

    The sample is the one `lipdp.callbacks.BoundMonitor` looks at after its first epoch:
    for arrays, ``min(sample_size, n)`` distinct examples drawn by
    ``np.random.default_rng([seed, 0])``; for a batched dataset, its first `sample_size`
    examples.

    **Not private** on training data: the norms are computed from the records outside
    the noisy gradient, and epsilon does not cover them.

    Args:
        model: a DP model (`DP_Sequential` / `DP_Model`) compiled with a DP loss.
        data: ``(x, y)`` arrays or a batched `tf.data.Dataset` of ``(x, y)``.
        sample_size: examples in the sample.
        seed: seed of the draw from arrays.
        chunk_size: examples whose per-example gradients are held in memory at once.

    Returns:
        ``{name: {"bound": float, "norms": [float, ...]}}`` with the names of
        `lipdp.bounds.variable_names`, in the order of ``model.trainable_variables``;
        None for a clipped-mode model (classic DP-SGD: the clipping, not an analytic
        bound, limits the gradients, so there is no bound to compare with).

    Raises:
        ValueError: `model` is not a DP model compiled with a DP loss.
    """
    from lipdp.bounds import gradient_bounds, per_example_loss_of, variable_names
    from lipdp.callbacks import sample_examples
    from lipdp.metadata import DPMode
    from lipdp.per_example import chunked_gradient_norms
    from lipdp.state_guard import run_guarded

    parameters = getattr(model, "dp_parameters", None)
    loss = getattr(model, "dp_loss", None)
    if parameters is None or loss is None:
        raise ValueError("gradient_norm_sample needs a DP model (DP_Sequential or DP_Model) "
                         f"compiled with a DP loss. Received: {type(model).__name__}"
                         + ("" if parameters is None else " without a DP loss"))
    if parameters.mode is DPMode.CLIPPED:
        return None
    bounds = gradient_bounds(model, loss)
    names = variable_names(model)
    norms = run_guarded(model, "per-example gradients", lambda: chunked_gradient_norms(
        model, per_example_loss_of(model, loss), [sample_examples(data, sample_size, seed)],
        chunk_size))
    return {names[v.ref()]: {"bound": bounds[names[v.ref()]], "norms": n.tolist()}
            for v, n in zip(model.trainable_variables, norms)}


def tightness_from_norms(gradient_norms: Dict[str, dict]) -> Dict[str, Dict[str, float]]:
    """The tightness summary of `gradient_norm_sample`'s output: per variable, its bound
    and the max and mean of ``norm / bound`` over the sample (the format of
    `lipdp.bounds.tightness` and `BoundMonitor.last_report`). Non-finite norms (written
    as null) are left out."""
    from lipdp.bounds import tightness_summary

    summary = {}
    for name, row in gradient_norms.items():
        bound = row["bound"]
        norms = [n for n in row["norms"] if n is not None]
        if norms and bound is not None and bound > 0:
            summary[name] = tightness_summary(bound, norms)
    return summary


def _jsonable(value):
    """`value` as plain JSON types: numpy scalars and arrays to numbers and lists, tuples
    to lists, enums to their values, keys to strings, objects with ``as_dict()`` (the
    results of `lipdp.audit`) to their dict, NaN and infinities to None."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(_jsonable(k)): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "as_dict"):
        return _jsonable(value.as_dict())
    if hasattr(value, "numpy"):  # a TF scalar or tensor
        return _jsonable(value.numpy())
    raise TypeError(f"Cannot write a {type(value).__name__} into a run report: {value!r}")


def build_report(cfg: dict, history, results: Optional[dict], *,
                 gradient_norms: Optional[Dict[str, dict]] = None,
                 tightness: Optional[Dict[str, dict]] = None,
                 audit=None) -> dict:
    """The JSON-ready report of one run (format in the module docstring).

    Args:
        cfg: the run's config (``lipdp.config``; its ``dataset.seed`` is the report's
            ``seed``, else ``results["seed"]``).
        history: the `tf.keras.callbacks.History` that ``fit`` returned, its
            ``.history`` dict, or None. Its `EPOCH_KEYS` lists that are present are
            copied to ``per_epoch``, with ``epoch`` numbering the longest: the History's
            own 0-based ``epoch`` indices plus one when it has one per value (a run
            resumed at its fifth epoch starts at 5), else 1, 2, ...
        results: the final results the CLI prints (epsilon, delta, test_accuracy,
            certified_accuracy, ...), or None.
        gradient_norms: `gradient_norm_sample`'s output.
        tightness: ``{var: {"bound", "max_ratio", "mean_ratio", "examples"}}``
            (`lipdp.bounds.tightness`, `BoundMonitor.last_report`); derived from
            `gradient_norms` (`tightness_from_norms`) when not given.
        audit: `lipdp.audit` results (objects with ``as_dict()``, or a dict of them).

    Returns:
        A dict of plain JSON types: ``json.loads(json.dumps(report)) == report``.
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"`cfg` must be the run's config dict. Received: {type(cfg).__name__}")
    if results is not None and not isinstance(results, dict):
        raise TypeError(f"`results` must be a dict or None. Received: {type(results).__name__}")
    logs = getattr(history, "history", history) or {}
    if not isinstance(logs, dict):
        raise TypeError("`history` must be a Keras History, its .history dict or None. "
                        f"Received: {type(history).__name__}")
    per_epoch = {key: [_jsonable(v) for v in logs[key]] for key in EPOCH_KEYS if key in logs}
    epochs = max((len(values) for values in per_epoch.values()), default=0)
    indices = list(getattr(history, "epoch", None) or [])
    numbers = ([int(i) + 1 for i in indices] if len(indices) == epochs
               else list(range(1, epochs + 1)))
    per_epoch = {"epoch": numbers, **per_epoch}
    if tightness is None and gradient_norms:
        tightness = tightness_from_norms(_jsonable(gradient_norms))
    seed = (cfg.get("dataset") or {}).get("seed", (results or {}).get("seed"))
    return _jsonable({
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg, "versions": versions(), "seed": seed, "per_epoch": per_epoch,
        "results": results, "gradient_norms": gradient_norms, "tightness": tightness or None,
        "audit": audit,
    })


# --------------------------------------------------------------------------- #
# The run folder.
# --------------------------------------------------------------------------- #
def atomic_write(path: str, write: Callable) -> str:
    """Write `path` whole or not at all: `write(file)` fills a temporary file in the same
    folder, which is flushed, fsynced and renamed over `path` (`os.replace`, atomic on
    POSIX and Windows). On failure the temporary file is removed and any previous
    `path` is left as it was."""
    folder, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    with contextlib.suppress(OSError, AttributeError):  # the rename itself, where supported
        directory = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    return path


def write_run(run_dir: str, report: dict, plots: bool = True) -> List[str]:
    """Create `run_dir` (if needed) and write ``report.json`` and, with `plots`, the plots.

    ``report.json`` is replaced atomically (`atomic_write`): a reader never sees half
    a report, and a failed write keeps the previous one. It is written before the plots,
    so a run whose plotting fails (matplotlib missing) keeps its report: `redraw` draws
    the plots later.

    Returns:
        The written paths: ``report.json`` first, then the plots (`draw_plots`).

    Raises:
        ImportError: `plots` is true and matplotlib is not installed (after
            ``report.json`` was written).
    """
    os.makedirs(run_dir, exist_ok=True)
    text = _dumps(_jsonable(report)) + "\n"
    written = [atomic_write(os.path.join(run_dir, REPORT_FILE),
                             lambda f: f.write(text.encode("utf-8")))]
    if plots:
        written += draw_plots(report, run_dir)
    return written


def _dumps(value, indent: str = "") -> str:
    """Indented JSON whose lists of numbers (per-epoch values, gradient norms) stay on one
    line, so that a person can read the file; the same value as `json.dumps`."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, allow_nan=False)


def _check_report(report, where: str) -> dict:
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise ReportError(f"{where} is not a lipdp run report (no \"format\": \"{FORMAT}\").")
    version = report.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ReportError(f"{where} has format_version {version!r}, which no lipdp wrote "
                          "(a positive integer).")
    if version > FORMAT_VERSION:
        raise ReportError(f"{where} has format_version {version!r}; this lipdp reads version "
                          f"{FORMAT_VERSION} and older: upgrade lipdp.")
    expected = {"per_epoch": dict, "results": (dict, type(None)),
                "gradient_norms": (dict, type(None)), "tightness": (dict, type(None))}
    for key, types in expected.items():
        if not isinstance(report.get(key, {}), types):
            raise ReportError(f"{where}: \"{key}\" should be an object (or null for an optional "
                              f"part); found {type(report[key]).__name__}.")
    return report


def read_report(run_dir: str) -> dict:
    """The report of a run folder.

    Raises:
        FileNotFoundError: `run_dir` is not a folder, or has no ``report.json``.
        ReportError: ``report.json`` is not valid JSON or not a lipdp run report.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"Run folder '{run_dir}' does not exist (or is not a folder).")
    path = os.path.join(run_dir, REPORT_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"'{run_dir}' has no {REPORT_FILE}: is it a run folder written "
                                "by `lipdp train`?")
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ReportError(f"'{path}' is corrupt: not valid JSON ({error}). Re-run the training "
                          "to write it again.") from error
    return _check_report(report, f"'{path}'")


def redraw(run_dir: str) -> List[str]:
    """Re-draw the plots of a run folder from its ``report.json`` (`draw_plots`).

    Returns:
        The paths of the plots written (``report.json`` is left as it is).

    Raises:
        FileNotFoundError, ReportError: as `read_report`.
        ImportError: matplotlib is not installed.
    """
    report = read_report(run_dir)
    try:
        return draw_plots(report, run_dir)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
        # A report.json edited by hand: a traceback from inside the plots (an audit,
        # 2026-12-07: 7 of 16 edits of its values). Chained: a file lipdp wrote that fails
        # here is a bug of lipdp's, whose traceback follows.
        raise ReportError(f"{os.path.join(run_dir, REPORT_FILE)} holds values its plots cannot "
                          f"be drawn from (edited by hand? if not, a lipdp bug): "
                          f"{type(error).__name__}: {error}") from error


# --------------------------------------------------------------------------- #
# Plots.
# --------------------------------------------------------------------------- #
def _figure(figsize):
    """A matplotlib figure on its own Agg canvas: no pyplot, no backend switch."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("Run report plots need matplotlib: pip install 'lipdp[reports]' "
                          "(then `lipdp report RUN_DIR` draws them from report.json).") from error
    figure = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _pairs(xs, ys):
    """Points with both coordinates known (None: NaN or inf in the report)."""
    return [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]


def _plot_accuracy_vs_epsilon(report):
    per_epoch = report.get("per_epoch") or {}
    results = report.get("results") or {}
    epsilon = per_epoch.get("epsilon") or []
    # An accuracy list pairs with epsilon epoch by epoch only when both have every epoch
    # (validation_freq > 1 gives fewer validation results: not drawn against epsilon).
    series = [(key, label, _pairs(epsilon, per_epoch.get(key) or []))
              for key, label in (("val_accuracy", "test accuracy, per epoch"),
                                 ("accuracy", "training accuracy, per epoch (not private)"))
              if len(per_epoch.get(key) or []) == len(epsilon)]
    final = _pairs([results.get("epsilon")], [results.get("test_accuracy")])
    if not final and not any(points for _, _, points in series):
        return None
    figure = _figure((6.4, 4.4))
    ax = figure.add_subplot()
    for key, label, points in series:
        if not points:
            continue
        eps, acc = zip(*points)
        if key == "val_accuracy":
            ax.scatter(eps, acc, color="tab:green", s=22, label=label, zorder=3)
            if len(points) <= 30:  # epoch numbers, while they stay readable
                for epoch, (e, a) in enumerate(zip(eps, acc), start=1):
                    ax.annotate(str(epoch), (e, a), textcoords="offset points", xytext=(3, 3),
                                fontsize="x-small", color="tab:green")
            order = np.argsort(eps, kind="stable")
            front = np.maximum.accumulate(np.asarray(acc)[order])
            ax.step(np.asarray(eps)[order], front, where="post", color="tab:green", alpha=0.6,
                    label="Pareto front (best accuracy at epsilon <= x)")
        else:
            ax.plot(eps, acc, linestyle="--", marker=".", color="tab:gray", label=label)
    if final:
        ax.scatter(*zip(*final), marker="*", s=160, color="tab:red", zorder=4,
                   label="final test accuracy")
    ax.set_xlabel("epsilon spent (delta = {})".format(results.get("delta", "?")))
    ax.set_ylabel("accuracy")
    ax.set_title("Accuracy vs privacy over training")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    return figure


def _plot_certified_accuracy(report):
    certified = (report.get("results") or {}).get("certified_accuracy") or {}
    points = sorted(_pairs([float(r) for r in certified], list(certified.values())))
    if not points:
        return None
    figure = _figure((6.4, 4.4))
    ax = figure.add_subplot()
    radii, accuracy = zip(*points)
    ax.plot(radii, accuracy, marker="o", color="tab:blue")
    ax.set_xlabel("L2 radius in input space")
    ax.set_ylabel("certified accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    lipschitz = (report.get("results") or {}).get("lipschitz_constant")
    ax.set_title("Certified accuracy vs radius"
                 + ("" if lipschitz is None else f" (Lipschitz constant {lipschitz:.4g})"))
    ax.grid(alpha=0.3)
    return figure


def _plot_gradient_norms(report):
    rows = {name: row for name, row in (report.get("gradient_norms") or {}).items()
            if row.get("bound") is not None and any(n is not None for n in row.get("norms", []))}
    if not rows:
        return None
    columns = min(4, len(rows))
    lines = math.ceil(len(rows) / columns)
    figure = _figure((3.2 * columns, 2.6 * lines + 0.4))
    axes = figure.subplots(lines, columns, squeeze=False).ravel()
    for ax, (name, row) in zip(axes, rows.items()):
        norms = np.array([n for n in row["norms"] if n is not None])
        bound = row["bound"]
        ax.hist(norms, bins=30, range=(0.0, 1.05 * max(bound, float(norms.max()))),
                color="tab:blue", alpha=0.8)
        ax.axvline(bound, color="tab:red", linestyle="--", label=f"bound {bound:.3g}")
        ax.set_title(f"{name}\nmax/bound = {norms.max() / bound:.3f}", fontsize="small")
        ax.set_xlabel("per-example gradient norm", fontsize="small")
        ax.set_ylabel("examples", fontsize="small")
        ax.legend(fontsize="x-small")
    for ax in axes[len(rows):]:
        ax.set_visible(False)
    figure.suptitle(f"Per-example gradient norms vs their bound "
                    f"({max(len(r['norms']) for r in rows.values())} examples)")
    return figure


def _plot_tightness(report):
    rows = {name: row for name, row in (report.get("tightness") or {}).items()
            if row.get("max_ratio") is not None and row.get("mean_ratio") is not None}
    if not rows:
        return None
    names = list(rows)
    position = np.arange(len(names))
    figure = _figure((max(6.4, 0.6 * len(names) + 2.0), 4.8))
    ax = figure.add_subplot()
    ax.bar(position - 0.2, [rows[n]["max_ratio"] for n in names], 0.4, label="max",
           color="tab:orange")
    ax.bar(position + 0.2, [rows[n]["mean_ratio"] for n in names], 0.4, label="mean",
           color="tab:blue")
    ax.axhline(1.0, color="tab:red", linestyle="--", label="bound (ratio 1)")
    ax.set_xticks(position)
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize="small")
    ax.set_ylabel("observed gradient norm / bound")
    ax.set_ylim(0, 1.1 * max(1.0, max(rows[n]["max_ratio"] for n in names)))
    ax.set_title("Tightness of the gradient bounds per variable")
    ax.legend(fontsize="small")
    return figure


_PLOTTERS = {"accuracy_vs_epsilon": _plot_accuracy_vs_epsilon,
             "certified_accuracy": _plot_certified_accuracy,
             "gradient_norms": _plot_gradient_norms,
             "tightness": _plot_tightness}


def draw_plots(report: dict, run_dir: str) -> List[str]:
    """Draw the plots of `report` into `run_dir` (created if needed), as PNG files.

    Each plot (`PLOT_FILES`) is drawn when the report holds its data and skipped
    otherwise: accuracy vs epsilon needs at least one (epsilon, accuracy) point (per
    epoch, or the final results); certified accuracy needs ``results.certified_accuracy``;
    the histograms need ``gradient_norms``; the bar chart needs ``tightness``. A skipped
    plot's file left by an earlier drawing is removed, so the folder shows only what
    this report holds. Files are replaced atomically.

    Returns:
        The paths of the plots written, in `PLOT_FILES` order.

    Raises:
        ImportError: matplotlib is not installed (and some plot has data).
    """
    os.makedirs(run_dir, exist_ok=True)
    written = []
    for key, plotter in _PLOTTERS.items():
        path = os.path.join(run_dir, PLOT_FILES[key])
        figure = plotter(report)
        if figure is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        written.append(atomic_write(path, lambda f, figure=figure: figure.savefig(
            f, format="png", dpi=120)))
    return written
