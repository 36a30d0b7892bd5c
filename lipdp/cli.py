"""Command line: ``lipdp train CONFIG [--set section.field=value ...] [--run-dir DIR]``,
``lipdp sweep CONFIG --grid section.field=[v1,v2] [...] [--output runs.jsonl]``,
``lipdp report RUN_DIR`` and ``lipdp data NAME``.

``lipdp train`` loads a YAML config (`lipdp.config`), builds the data, the model
and the privacy accountant, trains with ``model.fit`` (one line per epoch with
loss, accuracy and epsilon) and ends with a summary: training time, the final
``(epsilon, delta)``, test accuracy and certified accuracy at each radius, and the
run folder it wrote (`lipdp.reports`: report.json and plots; ``lipdp report``
re-draws them). ``lipdp sweep`` trains every point of a grid, one run folder each.

Exit codes: 0 success; 1 the data cannot be found or read; 2 invalid command
line or config (a one-paragraph message, no traceback); 3 training stopped
without a usable model (a check inside a step failed, or the weights are no
longer finite; the message says how much privacy the steps taken spent).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import shutil
import statistics
import sys
import time
from typing import Optional, Sequence

import yaml

from lipdp.config import ConfigError, load_config

__all__ = ["main"]

EXIT_OK, EXIT_DATA, EXIT_CONFIG, EXIT_STOPPED = 0, 1, 2, 3
# In a run folder: the validated config (written first) and the training checkpoint.
CONFIG_FILE, CHECKPOINT_DIR, TRAINED_DIR = "config.json", "checkpoint", "trained"

_VERBOSE_HELP = ("also show TensorFlow's start-up log and warnings (hidden by default unless "
                 "TF_CPP_MIN_LOG_LEVEL is set)")
_OVERRIDE_HELP = ("override one config field, e.g. --set training.epochs=5 or "
                  "--set model.widths=[256,256]; the value is parsed as YAML "
                  "(repeatable)")


def _schema_help() -> str:
    """The schema block of `lipdp.config`'s docstring (sections, fields, defaults)."""
    import lipdp.config

    doc = lipdp.config.__doc__ or ""
    start, end = doc.find("Schema (defaults shown)::"), doc.find("\nArchitectures")
    if start < 0 or end < start:
        return ""
    return "config schema (defaults shown):" + doc[start + len("Schema (defaults shown)::"):end]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lipdp",
        description="Differentially private training of Lipschitz networks (Clipless DP-SGD).",
        epilog="Run 'lipdp train --help' for the options of a training run.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    train = sub.add_parser(
        "train",
        help="train a model described by a YAML config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Lipschitz network with Clipless DP-SGD as described by a YAML\n"
                    "config, then report (epsilon, delta), test accuracy and certified accuracy.\n"
                    "Every field has a default; a config file states only what differs.",
        epilog=_schema_help() + "\nexamples:\n  lipdp train configs/fashion_mnist.yaml "
               "--set training.epochs=2\n  lipdp train --resume runs/fashion_mnist-20261124-120000"
               "\n\nexit codes: 0 success, 1 data not found or "
               "corrupt, 2 invalid command line or config, 3 training stopped without a usable "
               "model",
    )
    train.add_argument("config", metavar="CONFIG", nargs="?",
                       help="path of the YAML config file (not with --resume)")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.FIELD=VALUE", help=_OVERRIDE_HELP)
    train.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    train.add_argument("--run-dir", default=None, metavar="DIR",
                       help="run folder for config.json, the checkpoint, report.json and the "
                            "plots (default runs/<config name>-<date>-<time>)")
    train.add_argument("--resume", default=None, metavar="RUN_DIR",
                       help="resume a killed run from the checkpoint of its run folder (its "
                            "config.json; the privacy ledger continues, budget included)")
    sweep = sub.add_parser(
        "sweep", help="train every combination of a grid of config values, recording each run",
        description="Train one run per combination of the --grid values (cartesian product) "
                    "on top of CONFIG and --set, append each run's config and results as one "
                    "JSON line to --output, and print a table with the mean and standard "
                    "deviation. Tuning on private data costs privacy: see the README.",
        epilog="example:\n  lipdp sweep configs/breast_cancer.yaml --grid dataset.seed=[0,1,2,3,4]",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_argument("config", metavar="CONFIG", help="path of the YAML config file")
    sweep.add_argument("--grid", action="append", default=[], metavar="SECTION.FIELD=[V1,V2]",
                       help="one axis of the grid (repeatable; values parsed as YAML)")
    sweep.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.FIELD=VALUE", help=_OVERRIDE_HELP)
    report = sub.add_parser("report", help="re-draw the plots of a run folder from its report.json")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by 'lipdp train'")
    sub.add_parser("data", add_help=False,
                   help="check that a dataset can be found or downloaded ('lipdp data --help')")
    sweep.add_argument("--output", default="sweep.jsonl",
                       help="JSON-lines file the runs are appended to (default sweep.jsonl)")
    sweep.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    sweep.add_argument("--run-dir", default=None, metavar="DIR",
                       help="folder holding one run folder per grid point (default "
                            "runs/<config name>-<date>-<time>)")
    return parser


class _StdoutHandler(logging.StreamHandler):
    """Writes to the *current* ``sys.stdout`` (so output stays in order with prints)."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def _yaml_flow(value) -> str:
    """`value` as one line of YAML flow style (what `--set` parses back)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return text[:-3].strip() if text.endswith("\n...") else text  # scalar doc end


def _format_config(cfg) -> str:
    """One ``section:`` per line, then ``  field: value`` (values in YAML flow style)."""
    lines = []
    for section, fields in cfg.items():
        lines.append(f"{section}:")
        for field, value in fields.items():
            lines.append(f"  {field}: {_yaml_flow(value)}")
    return "\n".join(lines)


def _section(title: str):
    print(f"\n=== {title} ===")


def _print_table(rows, header):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for row in [header] + rows:
        print("  " + "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))


def _sampler(metadata) -> str:
    if metadata.sampling.value == "poisson":
        return (f"Poisson (each example in each step with probability q = "
                f"{metadata.sampling_rate:.4g})")
    return ("shuffled fixed batches (NOT what the accountant assumes: epsilon is the "
            "literature's heuristic, not a proof)")


def _seed(seed) -> str:
    """The sampling seed as the summary shows it: a given seed with what it costs."""
    if seed is None:
        return "seed secret (drawn from the system's randomness)"
    return (f"seed {seed}, given: epsilon holds only while it stays secret (a published seed "
            "tells which steps drew an example; lipdp.data.KnownSeedWarning)")


def _radius_label(radius: float) -> str:
    """``0.1412 (36/255)`` for radii that are whole multiples of 1/255, else ``0.1``."""
    pixels = round(radius * 255)
    if pixels and abs(radius * 255 - pixels) < 1e-9 and pixels % 255:
        return f"{radius:.4g} ({pixels}/255)"
    return f"{radius:g}"


def _print_bounds(cfg, model, metadata):
    """Clipless DP-SGD: the certified constants and the gradient bounds at initialisation."""
    from lipdp.bounds import gradient_bounds, lipschitz_bound

    print(f"certified Lipschitz constant (input -> logits): {float(lipschitz_bound(model)):.6g}")
    print(f"loss: {type(model.dp_loss).__name__}, Lipschitz constant w.r.t. logits "
          f"{model.dp_loss.lipschitz(metadata.nb_classes):.6g}")

    _section("Gradient bounds at initialisation")
    bounds = gradient_bounds(model)  # in the order of model.trainable_variables
    d = metadata.batch_size
    _print_table([[name, f"{b:.6g}", f"{b / d:.6g}"] for name, b in bounds.items()],
                 ["variable", "per-example bound", f"sensitivity (/ D={d})"])
    total = sum(b * b for b in bounds.values()) ** 0.5
    sigma = cfg["privacy"]["noise_multiplier"]
    if cfg["privacy"]["noisify_strategy"] == "global":
        noise = (f"noise std (global) = {sigma:g} x {total / d:.6g} = {sigma * total / d:.6g} "
                 "on every coordinate")
    else:
        noise = f"noise std (per-layer) = {sigma:g} x the variable's sensitivity"
    print(f"  global per-example bound sqrt(sum b^2) = {total:.6g}; {noise}")


def _print_clipping(cfg, model, metadata):
    """Classic DP-SGD: the clipping threshold(s) and the noise they calibrate."""
    from lipdp.bounds import variable_names

    p, d = cfg["privacy"], metadata.batch_size
    clip = p["l2_norm_clip"]
    if p["bound_fraction"] is not None:
        thresholds = model.dp_parameters.l2_norm_clip  # aligned with trainable_variables
        names = variable_names(model)
        print(f"classic DP-SGD, per-layer clipping: each variable's per-example gradient "
              f"clipped to {p['bound_fraction']:g} x its analytic bound at initialisation")
        _print_table([[names[v.ref()], f"{c:.6g}"]
                      for v, c in zip(model.trainable_variables, thresholds)],
                     ["variable", "threshold C_v"])
        total = sum(c * c for c in thresholds) ** 0.5
        print(f"noise std sigma sqrt(sum C_v^2) / D = {p['noise_multiplier']:g} x {total:.6g} / "
              f"{d} = {p['noise_multiplier'] * total / d:.6g} on every coordinate")
        return
    print(f"classic DP-SGD: every per-example gradient clipped to L2 norm C = "
          f"{clip:g}; noise std sigma C / D = {p['noise_multiplier']:g} x "
          f"{clip:g} / {d} = {p['noise_multiplier'] * clip / d:.6g} on "
          "every coordinate")


def _evaluate(network, test_inputs, radii):
    """``(test accuracy, {radius: certified accuracy}, certified Lipschitz constant, None)``, or
    ``(test accuracy, None, None, the layers without a certified constant)``: nothing is
    certified through a non-DP layer."""
    from lipdp import certify
    from lipdp.bounds import NonDPLayerError, lipschitz_bound
    from lipdp.clipping.validation import leaf_layers
    from lipdp.layers import DPLayer

    try:
        lip = float(lipschitz_bound(network))
    except NonDPLayerError:
        unbounded = [f"{x.name} ({type(x).__name__})" for x in leaf_layers(network)
                     if not isinstance(x, DPLayer)]
        accuracy = certify.certified_accuracy(network, test_inputs, [0.0])[0.0]
        return accuracy, None, None, ", ".join(unbounded)
    certified = certify.certified_accuracy(network, test_inputs, [0.0] + list(radii))
    return certified[0.0], certified, lip, None


def _default_run_dir(config_path: str) -> str:
    stem = os.path.splitext(os.path.basename(config_path))[0]
    return os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


def _membership_inference(model, ds_train, ds_test, count: int = 1000):
    """The loss-threshold attack (`lipdp.audit`) on training examples (one Poisson batch or
    more: members) against as many test examples (non-members)."""
    from lipdp.audit import membership_inference
    from lipdp.certify import first_examples

    members = first_examples(ds_train, count)
    holdout = first_examples(ds_test, len(members[0]))
    members = members[0][:len(holdout[0])], members[1][:len(holdout[0])]
    return membership_inference(model, members, holdout)


def _write_run(run_dir: str, cfg, history, results, model, ds_train, ds_test):
    """The run folder: report.json (config, versions, epsilon and accuracies per epoch, the
    results, per-example gradient norms against their bounds) and its plots (`lipdp.reports`)."""
    from lipdp import reports

    norms = attacks = None
    if model.dataset_metadata.augmentation_multiplicity > 1:  # the first view of each example
        ds_train = ds_train.map(lambda x, y: (x[:, 0], y))
    if not cfg["training"]["private_logs_only"]:  # computed on training data, outside epsilon
        norms = reports.gradient_norm_sample(model, ds_train, seed=cfg["dataset"]["seed"] or 0)
        attacks = _membership_inference(model, ds_train, ds_test)
        print(f"membership inference: {attacks.loss_threshold.summary()} (NOT PRIVATE: "
              "computed on training data; training.private_logs_only=true omits it)")
    report = reports.build_report(cfg, history, results, gradient_norms=norms,
                                  audit=None if attacks is None else
                                  {"membership_inference": attacks})
    try:
        reports.write_run(run_dir, report)
    except ImportError as e:
        print(f"run folder         : {run_dir} (report.json only: {e}; 'lipdp report "
              f"{run_dir}' draws the plots once matplotlib is installed)")
        return
    print(f"run folder         : {run_dir} (report.json and plots; 'lipdp report {run_dir}' "
          "re-draws them)")


class TrainingStopped(RuntimeError):
    """A run that ended without a usable model: a check inside a step stopped it, or its
    trained weights hold NaN or inf (nothing to evaluate or certify)."""


def _fit_or_stop(model, dataset, **kwargs):
    """``model.fit(dataset, **kwargs)``; `TrainingStopped` when a check inside a step
    stopped it (TensorFlow's error, first line kept) or when the trained weights are not all
    finite, saying how many steps were taken and the epsilon they spent (the ledger counts the
    steps that released an update: a stopped step released none)."""
    import numpy as np
    import tensorflow as tf

    from lipdp import accounting

    def spent():
        return (f"{model.dp_steps_taken} steps taken, epsilon="
                f"{accounting.format_epsilon(accounting.epsilon_spent(model))} spent at delta="
                f"{model.dp_parameters.delta:g}")

    try:
        history = model.fit(dataset, **kwargs)
    except tf.errors.InvalidArgumentError as e:
        # TensorFlow's message: "Graph execution error:", where the failed node was defined,
        # the check's own message, then the node's name ("[[{{node ...}}]]").
        lines = [line for line in e.message.splitlines()
                 if line.strip() and not line.lstrip().startswith("[[")]
        raise TrainingStopped(f"a check inside a training step failed ({spent()}): "
                              f"{lines[-1] if lines else e.message}") from e
    diverged = [v.name for v in model.weights if not np.isfinite(v.numpy()).all()]
    if diverged:
        raise TrainingStopped(
            f"training diverged ({spent()}): the weights of {', '.join(diverged[:3])}"
            + (f" and {len(diverged) - 3} more" if len(diverged) > 3 else "")
            + " hold NaN or inf, so there is nothing to evaluate or certify (a lower "
            "optimizer.learning_rate or dataset.input_bound may keep them finite).")
    return history


def _train(cfg, run_dir: str, resume: bool = False) -> dict:
    """One training run of a loaded config, printed section by section, its report written
    to `run_dir`; returns its results (the row a sweep records).

    The run folder holds config.json from the start and a checkpoint after every epoch
    (`lipdp.checkpoints.BackupAndRestore`, deleted when the run ends), from which
    ``resume=True`` continues a killed run: same steps, same final epsilon."""
    _section("Config")
    print(_format_config(cfg))

    # Heavy imports only once the config is known to be valid.
    from lipdp import accounting, reports
    from lipdp.checkpoints import (BackupAndRestore, FinishedTraining, finished_training,
                                   save_model_atomically)
    from lipdp.config import build_from_config, certification_target

    if not resume and not os.path.exists(os.path.join(run_dir, reports.REPORT_FILE)) and any(
            os.path.isdir(os.path.join(run_dir, d)) for d in (CHECKPOINT_DIR, TRAINED_DIR)):
        # Its checkpoint would be restored into this run, and its config.json overwritten
        # first (a review, 2026-12-07: an edited config started there lost the killed run's).
        raise ConfigError(f"{run_dir} holds a killed run (its checkpoint): resume it with "
                          f"'lipdp train --resume {run_dir}', or give another --run-dir.")
    _section("Data")
    model, ds_train, ds_test, metadata, fit_kwargs = build_from_config(cfg)
    if not resume:
        os.makedirs(run_dir, exist_ok=True)
        reports.atomic_write(os.path.join(run_dir, CONFIG_FILE),
                             lambda f: f.write(json.dumps(cfg, indent=1).encode()))
    # FinishedTraining before BackupAndRestore: the trained weights are kept before the
    # backup is deleted, until the report is written.
    trained_dir = os.path.join(run_dir, TRAINED_DIR)
    fit_kwargs["callbacks"] = fit_kwargs["callbacks"] + [
        FinishedTraining(trained_dir), BackupAndRestore(os.path.join(run_dir, CHECKPOINT_DIR))]
    print(f"{cfg['dataset']['name']}: {metadata.nb_samples_train} train / "
          f"{metadata.nb_samples_test} test examples of shape {metadata.input_shape}, "
          f"{metadata.nb_classes} classes; inputs bounded by {cfg['dataset']['bound']} to L2 "
          f"norm {metadata.max_norm:g}")
    print(f"sampling: {metadata.sampling.value}, expected batch size {metadata.batch_size} "
          f"(q = {metadata.sampling_rate:.4g}), {metadata.steps_per_epoch} steps per epoch")

    _section("Model")
    model.summary(print_fn=print)
    if cfg["privacy"]["mode"] == "clipped":
        _print_clipping(cfg, model, metadata)
    else:
        _print_bounds(cfg, model, metadata)

    _section("Plan")
    epochs = fit_kwargs["epochs"]
    if epochs * metadata.steps_per_epoch > accounting.MAX_STEPS:  # the accountant's
        # ValueError, with a traceback, before (an audit, 2026-12-07)
        raise ConfigError(f"training.epochs={epochs} makes {epochs * metadata.steps_per_epoch} "
                          f"steps of {metadata.steps_per_epoch} an epoch: the accountant counts "
                          "up to 2**62.")
    eps, delta = accounting.get_eps_delta(model, epochs)
    budget = cfg["privacy"]["epsilon_budget"]
    source = ("training.epochs" if cfg["training"]["epochs"] is not None
              else f"the most that fit in epsilon_budget={budget:g}")
    print(f"{epochs} epochs ({source}) = {epochs * metadata.steps_per_epoch} steps -> "
          f"epsilon={accounting.format_epsilon(eps)} at delta={delta:g}")
    if budget is not None:
        sigma = accounting.model_step_noise_multiplier(model)
        max_steps = accounting.max_steps_for_budget(budget, sigma, metadata.sampling_rate, delta)
        if eps > budget:
            last = accounting.compute_epsilon(sigma, metadata.sampling_rate, max_steps, delta)
            print(f"that exceeds epsilon_budget={budget:g}: the accountant will stop training "
                  f"after {max_steps} steps (epsilon={accounting.format_epsilon(last)})")
        else:
            print(f"the accountant stops training before epsilon exceeds {budget:g}")

    _section("Training")
    if not cfg["training"]["private_logs_only"]:
        print("note: the loss and accuracy Keras prints for training are computed on the "
              "training data outside the noisy gradient: NOT PRIVATE (not covered by epsilon). "
              "training.private_logs_only=true omits them; val_* and epsilon are what to share.")
    history = finished_training(trained_dir, model) if resume else None
    if history is not None:
        print(f"the run's training had finished ({model.dp_steps_taken} steps) when it was "
              f"killed: its trained weights and privacy ledger are restored from {trained_dir}; "
              "no step is taken again")
        wall = history.train_seconds
    else:
        print(f"checkpoint after every epoch in {os.path.join(run_dir, CHECKPOINT_DIR)} (a "
              f"killed run resumes with 'lipdp train --resume {run_dir}')"
              + ("; resuming from it now" if resume else ""))
        # A per-step progress bar only without per-step private values (C_t of adaptive
        # clipping): those of steps after the last checkpoint would be printed, and a resume
        # discards those steps from the ledger.
        per_step = sys.stdout.isatty() and model.dp_parameters.loss_gradient_clipping is None
        start = time.perf_counter()
        history = _fit_or_stop(model, ds_train, verbose=1 if per_step else 2, **fit_kwargs)
        wall = time.perf_counter() - start
    with contextlib.suppress(OSError):  # BackupAndRestore leaves its folder empty
        os.rmdir(os.path.join(run_dir, CHECKPOINT_DIR))

    radii = cfg["certification"]["radii"]
    network, test_inputs = certification_target(cfg, model, ds_test)
    accuracy, certified, lip, unbounded = _evaluate(network, test_inputs, radii)
    eps_final = accounting.epsilon_spent(model)
    # Epochs begun, those before a resume included (a budget stop ends one mid-way).
    epochs_run = -(-model.dp_steps_taken // metadata.steps_per_epoch)

    _section("Summary")
    print(f"training wall time : {wall:.1f} s ({epochs_run} epochs, {model.dp_steps_taken} steps"
          + ("; the time of the last process that trained: the run was resumed)" if resume
             else ")"))
    print(f"privacy            : (epsilon={accounting.format_epsilon(eps_final)}, "
          f"delta={delta:g})-DP"
          + ("" if budget is None else f"  [budget {budget:g}]"))
    for line in model.privacy_ledger.describe(delta).splitlines()[:-1]:
        print(f"ledger             : {line}")
    print(f"sampler            : {_sampler(metadata)}; {_seed(cfg['dataset']['seed'])}")
    print("accountant         : RDP (autodp), Poisson-subsampled Gaussian, converted to "
          "(epsilon, delta)")
    # fit ends a run of bjorck_every > 1 or of an EMA with a projection after the last
    # epoch's validation (`DP_Model._final_refresh`): its val_accuracy (report.json's
    # per_epoch) is not the final weights' (an audit, 2026-12-07: 0.0787 there, 0.0753 here;
    # a review found the EMA's case).
    refreshed = cfg["training"]["bjorck_every"] > 1 or \
        cfg["optimizer"]["ema_momentum"] is not None
    final = "final weights, projected after the last epoch" if refreshed else "final epoch"
    print(f"test accuracy      : {accuracy:.4f} ({final})")
    if certified is None:
        print(f"certified accuracy : none: no certified Lipschitz constant for {unbounded}, so "
              "no radius is certified")
    else:
        space = ("input space" if cfg["dataset"]["bound"] != "normalize" else
                 "the space of the normalised inputs (dataset.bound: normalize scales each "
                 "input to norm input_bound before the certified network, which that scaling "
                 "is not part of: these are not radii around the raw inputs)")
        print(f"certified accuracy : L2 radius in {space} (Lipschitz constant {lip:.4g})")
        _print_table([[_radius_label(r), f"{certified[r]:.4f}"] for r in radii],
                     ["radius", "accuracy"])
    auroc = None
    if metadata.nb_classes == 2:
        from lipdp.evaluation import binary_scores, roc_auc

        auroc = roc_auc(*binary_scores(network, test_inputs))
        print(f"test AUROC         : {auroc:.4f} ({final})")

    path = cfg["output"]["save_model"]
    if path is not None:
        save_model_atomically(model, path)
        print(f"model saved to {path}" + ("" if network is model else
              " (the head alone: it takes the scattering features; lipdp.config."
              "build_front_end(config['model'], input_bound) rebuilds the front end)"))
    results = {"epsilon": eps_final, "delta": delta, "test_accuracy": accuracy,
               "test_auroc": auroc,
               "certified_accuracy": None if certified is None else {str(r): certified[r]
                                                                     for r in radii},
               "lipschitz_constant": lip, "epochs": epochs_run,
               "steps": int(model.dp_steps_taken), "train_seconds": wall,
               "sampling": metadata.sampling.value, "seed": cfg["dataset"]["seed"]}
    _write_run(run_dir, cfg, history, results, model, ds_train, ds_test)
    shutil.rmtree(trained_dir, ignore_errors=True)  # report.json now marks the run finished
    return {**results, "run_dir": run_dir}


def _resume(args) -> int:
    """``lipdp train --resume RUN_DIR``: the run of RUN_DIR/config.json, continued from the
    checkpoint in RUN_DIR/checkpoint."""
    from lipdp import reports
    from lipdp.config import validate_config

    if args.config is not None or args.overrides or args.run_dir is not None:
        print("lipdp: --resume takes the config of the run folder: give no CONFIG, --set or "
              "--run-dir with it", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = args.resume
    if os.path.exists(os.path.join(run_dir, reports.REPORT_FILE)):
        print(f"lipdp: {run_dir} holds a finished run ({reports.REPORT_FILE}): nothing to resume",
              file=sys.stderr)
        return EXIT_CONFIG
    try:
        with open(os.path.join(run_dir, CONFIG_FILE)) as f:
            cfg = validate_config(json.load(f))
    except FileNotFoundError:
        print(f"lipdp: {run_dir} is not a run folder written by 'lipdp train' (no "
              f"{CONFIG_FILE})", file=sys.stderr)
        return EXIT_DATA
    if not any(os.path.isdir(os.path.join(run_dir, d)) for d in (CHECKPOINT_DIR, TRAINED_DIR)):
        print(f"lipdp: no checkpoint in {run_dir}: the run was killed before its first "
              "epoch ended; start it again", file=sys.stderr)
        return EXIT_DATA
    _train(cfg, run_dir, resume=True)
    return EXIT_OK


def _grid(assignments):
    """``["a.b=[1, 2]", "c.d=[x]"]`` -> every combination, as lists of override strings."""
    axes = []
    for text in assignments:
        key, _, raw = text.partition("=")
        values = yaml.safe_load(raw) if raw else None
        if not key or not isinstance(values, list) or not values:
            raise ConfigError(f"Invalid grid axis {text!r}: expected section.field=[v1, v2, ...], "
                              "e.g. dataset.seed=[0,1,2].")
        axes.append([f"{key.strip()}={_yaml_flow(v)}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def _sweep(args) -> int:
    """Every combination of the grid, one training run each, appended to a JSON-lines file."""
    combos = _grid(args.grid)
    configs = [load_config(args.config, args.overrides + combo) for combo in combos]  # all valid
    rows = []
    root = args.run_dir or _default_run_dir(args.config)
    for index, (combo, cfg) in enumerate(zip(combos, configs), 1):
        print(f"\n##### sweep run {index}/{len(combos)}: {' '.join(combo) or '(base config)'}")
        row = {"config_file": args.config, "overrides": args.overrides, "grid_point": combo,
               "config": cfg, **_train(cfg, os.path.join(root, f"run-{index:03d}"))}
        rows.append(row)
        with open(args.output, "a") as out:  # one line per finished run: nothing lost on a crash
            out.write(json.dumps(row) + "\n")
    _section(f"Sweep: {len(rows)} runs, recorded in {args.output}")
    metric = "test_auroc" if rows[0]["test_auroc"] is not None else "test_accuracy"
    from lipdp.accounting import format_epsilon

    _print_table([[" ".join(r["grid_point"]), format_epsilon(r["epsilon"]), f"{r[metric]:.4f}"]
                  for r in rows], ["grid point", "epsilon", metric])
    values = [r[metric] for r in rows]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    print(f"{metric}: mean {statistics.mean(values):.4f}, standard deviation {spread:.4f} over "
          f"{len(values)} runs")
    print("Each run's epsilon covers that run alone: releasing the best of these runs spends "
          "more, whatever scores choose it (the choice depends on every run, and every run "
          "trained on the same records), unless they trained on public data (README, "
          "'Tuning costs privacy').")
    return EXIT_OK


def _report(run_dir: str) -> int:
    """``lipdp report RUN_DIR``: re-draws the plots from report.json."""
    from lipdp import reports

    try:
        paths = reports.redraw(run_dir)
    except reports.ReportError as e:
        print(f"lipdp: {e}", file=sys.stderr)
        return EXIT_DATA
    print(f"lipdp: {len(paths)} plots drawn in {run_dir}: "
          + ", ".join(os.path.basename(p) for p in paths))
    return EXIT_OK


def _quiet_tensorflow():
    """Unless the user set ``TF_CPP_MIN_LOG_LEVEL``, TensorFlow's Python warnings are hidden
    too (its C++ start-up log already is: `lipdp/__init__.py`)."""
    import lipdp

    if lipdp._QUIET_TENSORFLOW:
        import tensorflow as tf

        tf.get_logger().setLevel(logging.ERROR)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``lipdp`` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _quiet_tensorflow()
    if argv[:1] == ["data"]:
        from lipdp.data import main as data_main

        try:
            return data_main(argv[1:], prog="lipdp data")
        except SystemExit as e:  # --help (0) or a usage error (2)
            return int(e.code or 0)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)

    logger = logging.getLogger("lipdp")
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    previous = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # no duplicates through handlers the root logger may have
    try:
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "report":
            return _report(args.run_dir)
        if args.resume is not None:
            return _resume(args)
        if args.config is None:
            parser.error("the following arguments are required: CONFIG (or --resume RUN_DIR)")
        cfg = load_config(args.config, args.overrides)
        _train(cfg, args.run_dir or _default_run_dir(args.config))
        return EXIT_OK
    except ConfigError as e:
        print(f"lipdp: invalid config: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except FileNotFoundError as e:
        print(f"lipdp: {e}", file=sys.stderr)
        return EXIT_DATA
    except TrainingStopped as e:
        print(f"lipdp: {e}", file=sys.stderr)
        return EXIT_STOPPED
    except ValueError as e:
        from lipdp.checkpoints import BackupMismatchError
        from lipdp.data import DatasetFormatError
        from lipdp.ledger import LedgerMismatchError

        if isinstance(e, DatasetFormatError):
            print(f"lipdp: corrupt dataset: {e}", file=sys.stderr)
            return EXIT_DATA
        if isinstance(e, (LedgerMismatchError, BackupMismatchError)):  # a run folder's config
            # edited before --resume
            print(f"lipdp: invalid config: {args.resume or args.run_dir}/{CONFIG_FILE} is not "
                  f"the config of the run its checkpoint holds. {e}", file=sys.stderr)
            return EXIT_CONFIG
        raise
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]


if __name__ == "__main__":
    sys.exit(main())
