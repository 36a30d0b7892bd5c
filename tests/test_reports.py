"""lipdp.reports: report.json, the run folder and its plots.

References are independent of the module's code path: per-epoch lists against the
`History` a real `fit` returned; per-example gradient norms against one `tf.GradientTape`
per example (`tests/_soundness.py`, not `lipdp.per_example`'s vectorised map) on the sample
drawn by hand (``np.random.default_rng([seed, 0])``, as `BoundMonitor` documents), bounds
against `lipdp.bounds.gradient_bounds`. Tolerances: float32 per-example gradients computed
two ways agree to ~1e-6 relative, 1e-5 leaves room for that; the bound check uses the
suite's `REL_TOL` (1e-4, `tests/_soundness.py`). PNGs are checked by their signature, by
decoding them (matplotlib's own reader) and by their pixels not all being one colour.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests._models import cnn, mlp
from tests._soundness import REL_TOL, per_example_gradient_norms
from lipdp import reports
from lipdp.bounds import gradient_bounds
from lipdp.callbacks import DP_Accountant
from lipdp.losses import DP_TauCategoricalCrossentropy
from lipdp.metadata import DPParameters
from lipdp.model import DP_Sequential

REL = 1e-5
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CFG = {"dataset": {"name": "synthetic", "seed": 7}, "privacy": {"mode": "clipless"},
       "certification": {"radii": [0.1, 0.5]}}


def _data(shape, nb_classes, n=64, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.normal(size=(n,) + shape)).astype(np.float32)
    return x, np.eye(nb_classes, dtype=np.float32)[rng.integers(0, nb_classes, n)]


@pytest.fixture(scope="module")
def run():
    """A small conv model trained two epochs (with the accountant and validation data),
    and the gradient-norm sample of its final weights on its training data."""
    tf.keras.utils.set_random_seed(0)
    model = cnn(nb_classes=4, strategy="global", sigma=2.0)
    model.compile(tf.keras.optimizers.SGD(0.05), DP_TauCategoricalCrossentropy(4.0),
                  metrics=["accuracy"])
    x, y = _data((8, 8, 2), 4, scale=3.0)  # norms around the input bound X0 = 3
    history = model.fit(x, y, epochs=2, verbose=0, validation_data=_data((8, 8, 2), 4, 32, 1),
                        callbacks=[DP_Accountant()])
    norms = reports.gradient_norm_sample(model, (x, y), sample_size=12, seed=5)
    results = {"epsilon": history.history["epsilon"][-1], "delta": 1e-5,
               "test_accuracy": np.float32(history.history["val_accuracy"][-1]),
               "test_auroc": None, "certified_accuracy": {"0.0": 0.5, "0.1": 0.25, "0.5": 0.0},
               "lipschitz_constant": 1.0, "epochs": 2, "steps": 8, "train_seconds": 1.5,
               "sampling": "shuffle", "seed": 7}
    return {"model": model, "x": x, "y": y, "history": history, "norms": norms,
            "results": results}


def _full_report(run):
    return reports.build_report(CFG, run["history"], run["results"],
                                gradient_norms=run["norms"])


def _assert_valid_png(path):
    from matplotlib.image import imread

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    assert os.path.getsize(path) > 5_000, path  # a drawn figure, not an empty canvas
    pixels = imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 300, (path, pixels.shape)
    assert pixels.reshape(-1, pixels.shape[-1]).std(axis=0).max() > 0.05, f"{path} is blank"


def _listing(folder):
    return sorted(os.listdir(folder))


# --------------------------------------------------------------------------- #
# Contents.
# --------------------------------------------------------------------------- #
def test_versions_lists_the_libraries():
    import platform

    found = reports.versions()
    for name in ("python", "lipdp", "tensorflow", "deel-lip", "autodp", "numpy", "matplotlib"):
        assert isinstance(found[name], str) and found[name], name
    assert found["python"] == platform.python_version()
    assert found["tensorflow"] == tf.__version__
    assert found["numpy"] == np.__version__


def test_report_round_trips_json_and_copies_the_history(run):
    """Per-epoch lists equal the History's (as Python floats), numpy scalars become
    numbers, the seed comes from the config, and JSON gives back the same dict."""
    report = _full_report(run)
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    logs = run["history"].history
    for key in ("epsilon", "val_accuracy", "accuracy", "loss", "val_loss"):
        assert report["per_epoch"][key] == [float(v) for v in logs[key]], key
    assert report["per_epoch"]["epoch"] == [1, 2]
    assert report["per_epoch"]["epsilon"][0] < report["per_epoch"]["epsilon"][1]
    assert report["seed"] == 7 and report["config"] == CFG
    assert report["results"]["test_accuracy"] == float(run["results"]["test_accuracy"])
    assert report["versions"] == reports.versions()
    assert report["format"] == "lipdp-run-report" and report["audit"] is None
    # Tightness derived from the norms when not given.
    for name, row in report["gradient_norms"].items():
        ratios = np.array(row["norms"]) / row["bound"]
        assert report["tightness"][name] == pytest.approx(
            {"bound": row["bound"], "max_ratio": ratios.max(), "mean_ratio": ratios.mean(),
             "examples": 12}, rel=1e-12)


def test_report_writes_non_finite_values_as_null_and_takes_audit_summaries():
    class Attack:
        def as_dict(self):
            return {"auroc": np.float64(0.5), "tpr_at_fpr": {0.01: 0.02}}

    history = {"loss": [1.0, float("nan")], "epsilon": np.array([0.5, np.inf]),
               "tightness_max/dense/kernel": [0.9, 0.9]}
    tightness = {"dense/kernel": {"bound": 3.0, "max_ratio": 0.9, "mean_ratio": 0.5,
                                  "examples": 4}}
    report = reports.build_report({"dataset": {"seed": 0}}, history, None, tightness=tightness,
                                  audit={"membership": Attack()})
    assert report["per_epoch"] == {"epoch": [1, 2], "epsilon": [0.5, None], "loss": [1.0, None]}
    assert report["audit"] == {"membership": {"auroc": 0.5, "tpr_at_fpr": {"0.01": 0.02}}}
    assert report["tightness"] == tightness and report["gradient_norms"] is None
    assert json.loads(json.dumps(report, allow_nan=False)) == report


def test_gradient_norm_sample_matches_one_tape_per_example(run):
    """Norms on the documented sample equal one-tape-per-example norms; bounds equal
    `gradient_bounds`; every norm is within its bound."""
    model, x, y, sample = run["model"], run["x"], run["y"], run["norms"]
    index = np.sort(np.random.default_rng([5, 0]).choice(len(x), 12, replace=False))
    expected = per_example_gradient_norms(model, model.dp_loss, x[index], y[index])
    bounds = gradient_bounds(model)
    assert list(sample) == list(bounds)  # every variable, in trainable_variables order
    for name, row in sample.items():
        assert row["bound"] == pytest.approx(bounds[name], rel=REL)
        np.testing.assert_allclose(row["norms"], expected[name], rtol=REL, atol=1e-7)
        assert max(row["norms"]) <= row["bound"] * (1 + REL_TOL), name
        assert max(row["norms"]) > 0, name


def test_gradient_norm_sample_on_a_dataset_takes_its_first_examples():
    model = mlp(nb_classes=3)
    model.compile(tf.keras.optimizers.SGD(0.1), DP_TauCategoricalCrossentropy(2.0))
    x, y = _data((10,), 3, n=20, scale=5.0)
    sample = reports.gradient_norm_sample(
        model, tf.data.Dataset.from_tensor_slices((x, y)).batch(4), sample_size=10)
    expected = per_example_gradient_norms(model, model.dp_loss, x[:10], y[:10])
    for name, row in sample.items():
        np.testing.assert_allclose(row["norms"], expected[name], rtol=REL, atol=1e-7)
        assert max(row["norms"]) <= row["bound"] * (1 + REL_TOL), name


def test_gradient_norm_sample_is_none_for_clipped_models_and_refuses_plain_models():
    layers = [tf.keras.layers.Input((10,)), tf.keras.layers.Dense(3)]
    clipped = DP_Sequential(
        layers, dp_parameters=DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0),
        dataset_metadata=mlp().dataset_metadata)
    clipped.compile(tf.keras.optimizers.SGD(0.1), DP_TauCategoricalCrossentropy(2.0))
    assert reports.gradient_norm_sample(clipped, _data((10,), 3)) is None
    plain = tf.keras.Sequential([tf.keras.layers.Input((10,)), tf.keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="needs a DP model"):
        reports.gradient_norm_sample(plain, _data((10,), 3))


# --------------------------------------------------------------------------- #
# The run folder.
# --------------------------------------------------------------------------- #
def test_write_run_replaces_report_whole_and_leaves_no_temporary_file(run, tmp_path, monkeypatch):
    folder = tmp_path / "runs" / "a"  # created, parents included
    os.makedirs(folder)
    (folder / "report.json").write_text("x" * 100_000)  # longer than the new report
    report = _full_report(run)
    written = reports.write_run(str(folder), report, plots=False)
    assert written == [str(folder / "report.json")]
    assert _listing(folder) == ["report.json"]
    assert json.loads((folder / "report.json").read_text()) == report

    # A write that fails before the rename keeps the previous report and cleans up.
    before = (folder / "report.json").read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(reports.os, "replace", failing_replace)
    changed = {**report, "seed": 123}
    with pytest.raises(OSError, match="disk full"):
        reports.write_run(str(folder), changed, plots=False)
    assert (folder / "report.json").read_bytes() == before
    assert _listing(folder) == ["report.json"]


def test_plots_are_valid_pngs_and_redraw_reproduces_them(run, tmp_path):
    folder = str(tmp_path / "run")
    written = reports.write_run(folder, _full_report(run))
    names = ["report.json", "accuracy_vs_epsilon.png", "certified_accuracy.png",
             "gradient_norms.png", "tightness.png"]
    assert written == [os.path.join(folder, n) for n in names]
    assert _listing(folder) == sorted(names)
    for path in written[1:]:
        _assert_valid_png(path)
    first = {path: open(path, "rb").read() for path in written[1:]}
    for path in first:
        os.remove(path)
    assert reports.redraw(folder) == written[1:]
    assert _listing(folder) == sorted(names)
    for path, content in first.items():
        assert open(path, "rb").read() == content, f"{path} drawn differently"


def test_missing_parts_skip_their_plots(run, tmp_path):
    folder = str(tmp_path / "run")
    reports.write_run(folder, _full_report(run))  # every plot, then a report without them
    results = {**run["results"], "certified_accuracy": None}
    report = reports.build_report(CFG, run["history"], results)
    assert report["gradient_norms"] is None and report["tightness"] is None
    written = reports.write_run(folder, report)
    assert written == [os.path.join(folder, n) for n in ("report.json", "accuracy_vs_epsilon.png")]
    assert _listing(folder) == ["accuracy_vs_epsilon.png", "report.json"]  # stale plots gone
    _assert_valid_png(written[1])
    # Nothing to draw at all: no history, no results.
    empty = reports.build_report({"dataset": {"seed": 0}}, None, None)
    assert empty["per_epoch"] == {"epoch": []}
    assert reports.write_run(folder, empty) == [os.path.join(folder, "report.json")]
    assert reports.redraw(folder) == []
    assert _listing(folder) == ["report.json"]


def test_redraw_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        reports.redraw(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="has no report.json"):
        reports.redraw(str(tmp_path))
    path = tmp_path / "report.json"
    path.write_text('{"format": "lipdp-run-report", "per_epoch": {')  # a truncated file
    with pytest.raises(reports.ReportError, match="corrupt: not valid JSON"):
        reports.redraw(str(tmp_path))
    path.write_text("[1, 2]")
    with pytest.raises(reports.ReportError, match="not a lipdp run report"):
        reports.redraw(str(tmp_path))
    path.write_text('{"format": "lipdp-run-report", "format_version": 1, "per_epoch": [1]}')
    with pytest.raises(reports.ReportError, match='"per_epoch" should be an object'):
        reports.redraw(str(tmp_path))
    path.write_text('{"format": "lipdp-run-report", "format_version": 99}')
    with pytest.raises(reports.ReportError, match="upgrade lipdp"):
        reports.redraw(str(tmp_path))
    for version in ("true", "0", "-5", '"1"'):
        path.write_text(f'{{"format": "lipdp-run-report", "format_version": {version}}}')
        with pytest.raises(reports.ReportError, match="which no lipdp wrote"):
            reports.redraw(str(tmp_path))
    # Values edited by hand: a traceback from inside the plots before (an audit, 2026-12-07)
    for edit in ('"per_epoch": {"epoch": [1, 2], "epsilon": 3.0, "val_accuracy": [0.1, 0.2]}',
                 '"per_epoch": {"epoch": [1]}, "results": {"certified_accuracy": [0.5]}',
                 '"per_epoch": {"epoch": [1]}, "results": {"certified_accuracy": {"abc": 0.5}}'):
        path.write_text(f'{{"format": "lipdp-run-report", "format_version": 1, {edit}}}')
        with pytest.raises(reports.ReportError, match="holds values its plots cannot be drawn"):
            reports.redraw(str(tmp_path))
    assert _listing(tmp_path) == ["report.json"]


def test_without_matplotlib_the_report_is_written_and_the_error_says_what_to_install(
        tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    report = reports.build_report({"dataset": {"seed": 0}}, {"epsilon": [1.0],
                                                             "val_accuracy": [0.5]}, None)
    with pytest.raises(ImportError, match=r"pip install 'lipdp\[reports\]'"):
        reports.write_run(str(tmp_path), report)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert _listing(tmp_path) == ["report.json"]
