"""Tests of lipdp.config and the `lipdp` command line.

Hermetic: the end-to-end run trains on a tiny synthetic Fashion-MNIST-shaped
IDX dataset written to a temporary directory and found through
``$LIPDP_DATA_DIR``; nothing is downloaded (the Keras loader is replaced by one
that fails).
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
import yaml

from lipdp import cli, config, data
from lipdp.bounds import lipschitz_bound
from lipdp.config import ConfigError, load_config
from lipdp.losses import DP_TauCategoricalCrossentropy
from tests.test_data import make_mnist_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_yaml(path, content):
    path.write_text(yaml.safe_dump(content) if isinstance(content, dict) else content)
    return str(path)


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    """Runs in a fresh directory: the default run folders (runs/...) are written there."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def no_download(tmp_path, monkeypatch):
    """No dataset reachable by accident (empty env dir, Keras home, Debian root, no network)."""
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setattr(data, "DEBIAN_DATASETS_DIR", str(tmp_path / "debian"))

    def offline():
        raise OSError("network disabled in tests")

    monkeypatch.setattr(tf.keras.datasets.fashion_mnist, "load_data", offline)
    return tmp_path


@pytest.fixture
def fake_fashion(no_download, monkeypatch):
    """Synthetic Fashion-MNIST (60 train / 30 test, 28x28 uint8) under $LIPDP_DATA_DIR."""
    root = no_download / "datasets"
    make_mnist_dir(str(root / "fashion_mnist"), n_train=60, n_test=30)
    monkeypatch.setenv(data.DATA_DIR_ENV, str(root))
    return root


# ----------------------------------------------------------------------------
# config: files, defaults, overrides
# ----------------------------------------------------------------------------


def test_shipped_main_config_has_the_measured_settings():
    cfg = load_config(os.path.join(REPO, "configs", "fashion_mnist.yaml"))
    assert cfg["dataset"] == {"name": "fashion_mnist", "batch_size": 5000, "input_bound": 10.0,
                              "bound": "clip", "sampling": "poisson", "seed": None,
                              "nb_samples_train": None, "data_dir": None,
                              "augmentation": None, "augmentation_multiplicity": 1}
    assert cfg["model"]["architecture"] == "mlp" and cfg["model"]["widths"] == [1024]
    assert cfg["model"]["use_bias"] is False and cfg["model"]["maxiter_bjorck"] == 1
    assert (cfg["loss"]["name"], cfg["loss"]["tau"]) == ("tau_cce", 5.0)
    assert (cfg["optimizer"]["name"], cfg["optimizer"]["learning_rate"]) == ("adam", 0.001)
    assert cfg["privacy"] == {"noise_multiplier": 3.0, "delta": 1e-5,
                              "noisify_strategy": "global", "epsilon_budget": 3.0,
                              "mode": "clipless", "l2_norm_clip": None,
                              "bound_fraction": None, "engine": "ghost",
                              "adaptive_clip_quantile": None, "adaptive_clip_noise": None,
                              "adaptive_clip_initial": None,
                              "adaptive_clip_learning_rate": 0.2}
    assert cfg["training"]["epochs"] is None
    assert cfg["certification"]["radii"] == [0.0, 36 / 255, 72 / 255, 108 / 255, 0.1, 0.25, 0.5]
    cnn = load_config(os.path.join(REPO, "configs", "fashion_mnist_cnn.yaml"))
    assert cnn["model"]["architecture"] == "cnn" and cnn["model"]["conv_filters"] == [32, 64]
    assert cnn["model"]["dense_width"] == 512


def test_defaults_partial_file_and_overrides(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "dataset:\n  batch_size: 100\nmodel:\n")
    cfg = load_config(path, ["training.epochs=3", "model.widths=[64, 32]",
                             "model.use_bias=true", "privacy.epsilon_budget=null",
                             "privacy.delta=1e-6", "optimizer.learning_rate=0.01"])
    assert cfg["dataset"]["batch_size"] == 100
    assert cfg["dataset"]["name"] == config.DEFAULT_CONFIG["dataset"]["name"]
    assert cfg["training"]["epochs"] == 3
    assert cfg["model"]["widths"] == [64, 32] and cfg["model"]["use_bias"] is True
    assert cfg["privacy"]["epsilon_budget"] is None
    # PyYAML reads "1e-6" as a string: numeric fields accept it as a number.
    assert cfg["privacy"]["delta"] == 1e-6 and isinstance(cfg["privacy"]["delta"], float)
    assert cfg["optimizer"]["learning_rate"] == 0.01
    # The defaults themselves are untouched, and validation is idempotent.
    assert config.DEFAULT_CONFIG["model"]["widths"] == [1024]
    assert config.validate_config(cfg) == cfg


@pytest.mark.parametrize("override, fragments", [
    ("dataset.batch_size=-5", ["`dataset.batch_size`", "positive integer", "dataset.batch_size=-5"]),
    ("dataset.batch_size=1.5", ["dataset.batch_size=1.5"]),
    ("dataset.name=imagenet", ["'fashion_mnist'", "dataset.name='imagenet'"]),
    ("dataset.bound=squash", ["'clip', 'normalize'", "dataset.bound='squash'"]),
    ("dataset.input_bound=0", ["finite positive", "dataset.input_bound=0"]),
    ("model.architecture=resnet", ["model.architecture='resnet'"]),
    ("model.widths=[64, -1]", ["list of positive integers", "model.widths=[64, -1]"]),
    ("model.use_bias=yes please", ["true or false", "model.use_bias='yes please'"]),
    ("model.maxiter_bjorck=0", ["positive integer", "model.maxiter_bjorck=0"]),
    ("model.maxiter_spectral=0", ["positive integer", "model.maxiter_spectral=0"]),
    ("loss.name=mse", ["'tau_cce'", "loss.name='mse'"]),
    ("loss.tau=-1", ["loss.tau=-1"]),
    ("loss.margin=-0.1", ["non-negative", "loss.margin=-0.1"]),
    ("optimizer.momentum=1.0", ["[0, 1)", "optimizer.momentum=1.0"]),
    ("optimizer.ema_momentum=1.0", ["(0, 1)", "optimizer.ema_momentum=1.0"]),
    ("optimizer.learning_rate_decay=linear", ["'cosine'", "optimizer.learning_rate_decay='linear'"]),
    ("privacy.delta=2", ["(0, 1)", "privacy.delta=2"]),
    ("privacy.noise_multiplier=abc", ["privacy.noise_multiplier='abc'"]),
    ("privacy.noisify_strategy=local", ["'per-layer'", "privacy.noisify_strategy='local'"]),
    ("privacy.mode=clip", ["'clipless', 'clipped'", "privacy.mode='clip'"]),
    ("privacy.l2_norm_clip=-1", ["finite positive", "privacy.l2_norm_clip=-1"]),
    ("training.epochs=0", ["training.epochs=0"]),
    ("certification.radii=[0.1, -1]", ["certification.radii=[0.1, -1]"]),
    ("output.save_model=3", ["output.save_model=3"]),
    # an OverflowError and TensorFlow's "out-of-range integer" before (an audit, 2026-12-07)
    pytest.param(f"privacy.noise_multiplier={10**400}",
                 ["`privacy.noise_multiplier`", "finite non-negative"], id="noise 10**400"),
    pytest.param(f"certification.radii=[{10**400}]",
                 ["`certification.radii`", "finite non-negative"], id="radius 10**400"),
    (f"dataset.seed={10**23}", ["`dataset.seed`", "[0, 2**63)"]),
    ("dataset.seed=-1", ["`dataset.seed`", "dataset.seed=-1"]),
])
def test_bad_values_are_echoed(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("overrides, fragment", [
    (["privacy.mode=clipped"], "set either privacy.l2_norm_clip or privacy.bound_fraction"),
    (["privacy.mode=clipped", "privacy.l2_norm_clip=1.0", "privacy.bound_fraction=0.5"],
     "set either privacy.l2_norm_clip or privacy.bound_fraction"),
    (["privacy.bound_fraction=0.5"], "it needs privacy.mode='clipped'"),
    (["privacy.engine=mixed-ghost"], "it needs privacy.mode='clipped'"),
    (["model.head=plain", "privacy.mode=clipped", "privacy.bound_fraction=0.5"],
     "set privacy.l2_norm_clip instead"),
    (["privacy.l2_norm_clip=1.0"], "only applies to privacy.mode='clipped'"),
    (["privacy.mode=clipped", "privacy.l2_norm_clip=1.0", "privacy.noisify_strategy=per-layer"],
     "needs privacy.noisify_strategy='global'"),
    (["model.architecture=tanh_cnn"], "train it with privacy.mode='clipped'"),
    (["model.head=plain"], "train it with privacy.mode='clipped'"),
    (["model.head=plain", "model.architecture=cnn", "privacy.mode=clipped",
      "privacy.l2_norm_clip=1.0"], "applies to the mlp and scatternet architectures"),
    (["loss.name=hinge", "loss.margin=0.1"], "needs loss.name='tau_cce'"),
])
def test_clipped_mode_cross_field_rules(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, overrides)


def test_unknown_keys_list_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="Unknown config key `model.depth`") as info:
        load_config(None, ["model.depth=3"])
    for key in ("model.architecture", "model.widths", "model.use_bias"):
        assert key in str(info.value)
    with pytest.raises(ConfigError, match="Unknown config section `trainer`.*training"):
        load_config(None, ["trainer.epochs=3"])
    path = write_yaml(tmp_path / "c.yaml", {"privacy": {"epsilon": 3.0}})
    with pytest.raises(ConfigError, match=r"`privacy.epsilon` in .*c.yaml.*privacy.epsilon_budget"):
        load_config(path)
    path = write_yaml(tmp_path / "d.yaml", {"optimiser": {"name": "sgd"}})
    with pytest.raises(ConfigError, match="Unknown config section `optimiser`.*optimizer"):
        load_config(path)


@pytest.mark.parametrize("override", ["training.epochs", "epochs=3", "a.b.c=1", "=3"])
def test_malformed_overrides(override):
    with pytest.raises(ConfigError, match="override"):
        load_config(None, [override])


def test_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="Cannot read config file"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="Invalid YAML"):
        load_config(write_yaml(tmp_path / "a.yaml", "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(write_yaml(tmp_path / "b.yaml", "- a\n- b\n"))
    with pytest.raises(ConfigError, match="`model`.*mapping of fields"):
        load_config(write_yaml(tmp_path / "c.yaml", "model: mlp\n"))


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="training.epochs.*epsilon_budget"):
        load_config(None, ["privacy.epsilon_budget=null"])
    with pytest.raises(ConfigError, match="noise_multiplier=0"):
        load_config(None, ["privacy.noise_multiplier=0"])
    with pytest.raises(ConfigError, match="exceeds"):
        load_config(None, ["dataset.nb_samples_train=10", "dataset.batch_size=20"])
    # Non-private runs are allowed when their length is given.
    load_config(None, ["privacy.noise_multiplier=0", "privacy.epsilon_budget=null",
                       "training.epochs=1"])


# ----------------------------------------------------------------------------
# builders
# ----------------------------------------------------------------------------


def test_build_cnn_is_the_papers_network(fake_fashion):
    cfg = load_config(None, ["model.architecture=cnn", "dataset.batch_size=20",
                             "privacy.epsilon_budget=null", "training.epochs=1",
                             "loss.name=hkr", "optimizer.name=sgd"])
    model, _, _, metadata, fit_kwargs = config.build_from_config(cfg)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["DP_BoundedInput",
                     "DP_QuickSpectralConv2D", "DP_GroupSort", "DP_ScaledL2NormPooling2D",
                     "DP_QuickSpectralConv2D", "DP_GroupSort", "DP_ScaledL2NormPooling2D",
                     "DP_Flatten", "DP_QuickSpectralDense", "DP_GroupSort",
                     "DP_QuickSpectralDense"]
    assert [model.layers[i].filters for i in (1, 4)] == [32, 64]
    assert model.layers[8].units == 512 and model.layers[-1].units == 10
    assert not any(getattr(layer, "use_bias", False) for layer in model.layers)
    assert model.layers[0].upper_bound == 10.0 and metadata.max_norm == 10.0
    assert type(model.dp_loss).__name__ == "DP_MulticlassHKR"
    assert isinstance(model.optimizer, tf.keras.optimizers.SGD)
    assert fit_kwargs["epochs"] == 1


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
@pytest.mark.parametrize("key", ["maxiter_bjorck", "maxiter_spectral"])
def test_projection_iterations_reach_every_projected_layer(fake_fashion, architecture, key):
    from deel.lip.normalizers import DEFAULT_MAXITER_BJORCK

    from lipdp.layers._projection import DEFAULT_MAXITER_SPECTRAL

    default = {"maxiter_bjorck": DEFAULT_MAXITER_BJORCK,
               "maxiter_spectral": DEFAULT_MAXITER_SPECTRAL}[key]
    for value, expected in ((None, default), (1, 1), (3, 3)):
        cfg = load_config(None, [f"model.architecture={architecture}", "dataset.batch_size=20",
                                 "privacy.epsilon_budget=null", "training.epochs=1",
                                 f"model.{key}={'null' if value is None else value}"])
        model = config.build_from_config(cfg)[0]
        projected = [layer for layer in model.layers if hasattr(layer, "projection")]
        assert len(projected) == (2 if architecture == "mlp" else 4)
        assert {getattr(layer.projection, key) for layer in projected} == {expected}


def test_config_compiles_with_its_bjorck_schedule(fake_fashion):
    cfg = load_config(None, ["dataset.batch_size=20", "privacy.epsilon_budget=null",
                             "training.epochs=1", "training.bjorck_every=4"])
    model, _, _, _, _ = config.build_from_config(cfg)
    assert model._bjorck_every == 4


def test_build_plain_head_for_clipped_dpsgd(fake_fashion):
    cfg = load_config(None, ["model.head=plain", "model.widths=[16]", "model.use_bias=true",
                             "privacy.mode=clipped", "privacy.l2_norm_clip=0.1",
                             "dataset.batch_size=20", "privacy.epsilon_budget=null",
                             "training.epochs=1"])
    model, _, _, _, _ = config.build_from_config(cfg)
    assert [type(x).__name__ for x in model.layers] == ["Flatten", "Dense", "Dense"]
    hidden, output = model.layers[1:]
    assert hidden.units == 16 and hidden.activation.__name__ == "tanh" and hidden.use_bias
    assert output.units == 10 and not output.kernel.numpy().any()  # zero-initialised
    assert model.dp_parameters.mode.value == "clipped"


def _plain_sgd_config(*overrides):
    """A plain linear head in clipped mode trained by SGD 0.5 for 2 epochs of 3 steps (no
    budget), plus `overrides`: what the optimizer options' tests train."""
    return load_config(None, ["model.head=plain", "model.widths=[]", "privacy.mode=clipped",
                              "privacy.l2_norm_clip=1.0", "dataset.batch_size=20",
                              "privacy.epsilon_budget=null", "training.epochs=2",
                              "optimizer.name=sgd", "optimizer.learning_rate=0.5",
                              *overrides])


def test_bound_fraction_clips_each_variable_at_that_fraction_of_its_bound(fake_fashion, tmp_path,
                                                                          capsys):
    """privacy.bound_fraction: classic DP-SGD with per-layer thresholds f bound(v), the analytic
    bounds of the model as built (before any training), printed and used by the step."""
    from lipdp.bounds import gradient_bounds

    cfg = load_config(None, ["model.widths=[16]", "privacy.mode=clipped",
                             "privacy.bound_fraction=0.25", "privacy.engine=mixed-ghost",
                             "dataset.batch_size=20",
                             "privacy.epsilon_budget=null", "training.epochs=1"])
    model, _, _, _, _ = config.build_from_config(cfg)
    params = model.dp_parameters
    assert params.mode.value == "clipped" and params.clipping.value == "per-layer"
    assert params.engine.value == "mixed-ghost" and model._clipped_dpsgd.engine.name == "mixed-ghost"
    bounds = gradient_bounds(model)
    assert params.l2_norm_clip == pytest.approx([0.25 * b for b in bounds.values()], rel=1e-6)
    np.testing.assert_allclose([float(s) * 20 for s in model.sensitivities()],
                               params.l2_norm_clip, rtol=1e-6)

    assert cli.main(["train", write_yaml(tmp_path / "fraction.yaml", cfg)]) == 0
    out = capsys.readouterr().out
    assert "clipped to 0.25 x its analytic bound at initialisation" in out
    for bound in bounds.values():  # (the CLI's model has its own layer names)
        assert f"{0.25 * bound:.6g}" in out
    total = sum((0.25 * b) ** 2 for b in bounds.values()) ** 0.5
    assert f"noise std sigma sqrt(sum C_v^2) / D = 3 x {total:.6g} / 20" in out
    assert "clipped (per-layer), sigma=3" in out.split("=== Summary ===")[1]


def test_ema_momentum_releases_the_average_of_the_iterates(fake_fashion):
    """optimizer.ema_momentum m: after fit the weights are ``a_T`` with ``a_0 = w_0``,
    ``a_t = m a_{t-1} + (1 - m) w_t`` over the iterates w_t (recorded after every step; a
    plain head in clipped mode, so no projection moves them after the optimizer)."""
    cfg = _plain_sgd_config("optimizer.ema_momentum=0.6")
    model, ds_train, _, _, fit_kwargs = config.build_from_config(cfg)
    assert model.optimizer.use_ema and model.optimizer.ema_momentum == 0.6
    average = [v.numpy() for v in model.trainable_variables]
    iterates = []

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            iterates.append([v.numpy() for v in model.trainable_variables])

    model.fit(ds_train, epochs=2, verbose=0, callbacks=[Record()])
    assert len(iterates) == model.dp_steps_taken == 6
    for w in iterates:
        average = [0.6 * a + 0.4 * x for a, x in zip(average, w)]
    for v, a, last in zip(model.trainable_variables, average, iterates[-1]):
        np.testing.assert_allclose(v.numpy(), a, rtol=1e-5, atol=1e-6)
        assert np.abs(v.numpy() - last).max() > 1e-4  # not the last iterate


def test_cosine_decay_takes_the_closed_form_steps_over_the_planned_steps(fake_fashion):
    """optimizer.learning_rate_decay=cosine: the rate each step applies (Keras records it in
    ``optimizer.learning_rate`` when it applies the step) is ``lr (1 + cos(pi t / T)) / 2``
    over the planned ``T = epochs x steps_per_epoch`` steps, t = 0, 1, ..."""
    cfg = _plain_sgd_config("optimizer.learning_rate_decay=cosine")
    model, ds_train, _, metadata, fit_kwargs = config.build_from_config(cfg)
    total = fit_kwargs["epochs"] * metadata.steps_per_epoch
    assert total == 6
    rates = []

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            rates.append(float(model.optimizer.learning_rate))

    model.fit(ds_train, epochs=fit_kwargs["epochs"], verbose=0, callbacks=[Record()])
    np.testing.assert_allclose(
        rates, [0.25 * (1 + np.cos(np.pi * t / total)) for t in range(total)], rtol=1e-6)


def test_a_decay_needs_the_planned_steps():
    with pytest.raises(ValueError, match="planned number of steps"):
        config.build_optimizer({**config.DEFAULT_CONFIG["optimizer"],
                                "learning_rate_decay": "cosine"})
    optimizer = config.build_optimizer({**config.DEFAULT_CONFIG["optimizer"],
                                        "learning_rate_decay": "cosine"}, total_steps=10)
    schedule = optimizer.get_config()["learning_rate"]  # serialised with the optimizer
    assert "CosineDecay" in str(schedule) and schedule["config"]["decay_steps"] == 10


def test_build_rejects_what_the_data_rejects(fake_fashion):
    # 60 training examples in the synthetic set: a batch of 100 cannot be drawn.
    with pytest.raises(ConfigError, match="batch_size"):
        config.build_from_config(load_config(None, ["dataset.batch_size=100"]))
    with pytest.raises(ConfigError, match="image inputs"):
        config.build_from_config(load_config(None, [
            "dataset.name=digits", "dataset.batch_size=100", "model.architecture=cnn"]))


@pytest.mark.parametrize("epochs", ["null", "2"])
def test_budget_too_small_for_one_step(fake_fashion, epochs):
    cfg = load_config(None, ["dataset.batch_size=30", "privacy.epsilon_budget=0.01",
                             f"training.epochs={epochs}"])
    with pytest.raises(ConfigError, match="does not allow a single step"):
        config.build_from_config(cfg)


def test_budget_shorter_than_one_epoch(fake_fashion):
    # q = 30/60, sigma = 3: one step spends epsilon 0.88, an epoch (2 steps) 1.20.
    cfg = load_config(None, ["dataset.batch_size=30", "privacy.epsilon_budget=1.0"])
    _, _, _, _, fit_kwargs = config.build_from_config(cfg)
    assert fit_kwargs["epochs"] == 1  # the accountant stops after the first step


# ----------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------


def test_help(capsys):
    assert cli.main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "CONFIG" in out and "--set" in out
    for field in ("epsilon_budget: 3.0", "architecture: mlp", "radii: [0.0, 0.1"):
        assert field in out  # the schema with its defaults
    assert cli.main([]) == 2  # no command
    assert cli.main(["fly"]) == 2


def test_bad_config_exits_2_without_traceback(tmp_path, capsys):
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xffdataset: {}\n")  # a UnicodeDecodeError's traceback (an audit)
    assert cli.main(["train", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "Traceback" not in err
    path = write_yaml(tmp_path / "c.yaml", {"dataset": {"batch_size": -1}})
    assert cli.main(["train", path]) == 2
    err = capsys.readouterr().err
    assert "dataset.batch_size=-1" in err and "Traceback" not in err
    assert cli.main(["train", path, "--set", "dataset.batch_size=10", "--set", "model.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "model.nope" in err and "model.widths" in err
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.parametrize("text, key", [
    ("privacy:\n  noise_multiplier: 8.0\n  delta: 1.0e-6\ndataset:\n  batch_size: 10\n"
     "privacy:\n  epsilon_budget: 3.0\n", "privacy"),
    ("privacy:\n  noise_multiplier: 8.0\n  noise_multiplier: 3.0\n", "noise_multiplier"),
])
def test_a_key_repeated_in_a_config_is_refused(tmp_path, text, key):
    """PyYAML keeps the last of repeated keys: a second `privacy:` section dropped the first
    one's noise multiplier and delta for the defaults, silently (found by an audit)."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"key '{key}' appears twice"):
        load_config(str(path))


def test_missing_data_exits_1(no_download, capsys):
    path = write_yaml(no_download / "c.yaml", {"dataset": {"batch_size": 10}})
    assert cli.main(["train", path]) == 1
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err


def test_train_end_to_end(fake_fashion, tmp_path, capsys):
    saved = tmp_path / "model.keras"
    path = write_yaml(tmp_path / "tiny.yaml", {
        "dataset": {"name": "fashion_mnist", "batch_size": 10, "nb_samples_train": 40,
                    "input_bound": 10.0, "seed": 0},
        "model": {"architecture": "mlp", "widths": [16]},
        # q = 10/40, sigma = 3: 4 steps/epoch, epsilon 1.18 after 2 epochs, 1.42 after 3.
        "privacy": {"noise_multiplier": 3.0, "delta": 1e-5, "epsilon_budget": 1.3},
        "certification": {"radii": [0.0, 0.01, 0.5]},
        "output": {"save_model": str(saved)},
    })
    assert cli.main(["train", path, "--set", "optimizer.learning_rate=0.01"]) == 0
    out = capsys.readouterr().out
    # the resolved config is printed as YAML that reads back to itself
    printed = out.split("=== Config ===")[1].split("=== Data ===")[0]
    assert yaml.safe_load(printed) == load_config(path, ["optimizer.learning_rate=0.01"])
    # data source, model, bounds, plan
    assert "loaded from" in out and str(fake_fashion) in out
    assert "DP_QuickSpectralDense" in out and "Total params" in out
    assert "per-example bound" in out and "kernel" in out
    assert "2 epochs (the most that fit in epsilon_budget=1.3) = 8 steps" in out
    # per epoch: Keras line with epsilon, and the accountant's line
    assert "Epoch 2/2" in out and "Epoch 3/" not in out
    # Keras' progress bar rounds to the nearest; lipdp's lines round up (1.17951...)
    assert "epsilon: 1.1795" in out and "lipdp: epoch 2: epsilon=1.18 " in out
    # summary
    summary = out.split("=== Summary ===")[1]
    assert "training wall time" in summary and "(2 epochs, 8 steps)" in summary
    assert "(epsilon=1.18, delta=1e-05)-DP" in summary
    assert "test accuracy" in summary and "certified accuracy" in summary
    assert "(final epoch)" in summary
    rows = [line.split() for line in summary.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["radius", "0", "0.01", "0.5"]
    accuracies = [float(r[1]) for r in rows[1:]]
    assert all(0 <= a <= 1 for a in accuracies)
    assert accuracies == sorted(accuracies, reverse=True)
    test_accuracy = float(summary.split("test accuracy")[1].split(":")[1].split()[0])
    assert test_accuracy == accuracies[0]
    assert saved.exists() and f"model saved to {saved}" in out
    # the run folder: report.json with the run's numbers, its plots, and 'lipdp report'
    run_dir = summary.split("run folder         : ")[1].split(" (")[0]
    assert run_dir.startswith(os.path.join("runs", "tiny-"))
    report = json.loads((tmp_path / run_dir / "report.json").read_text())
    assert report["results"]["epsilon"] == pytest.approx(1.1795, abs=1e-4)
    assert report["per_epoch"]["epoch"] == [1, 2] and len(report["per_epoch"]["epsilon"]) == 2
    assert report["results"]["certified_accuracy"]["0.5"] == accuracies[2]
    mia = report["audit"]["membership_inference"]["loss_threshold"]
    assert mia["nb_members"] == mia["nb_nonmembers"] == 30 and 0 <= mia["auroc"] <= 1
    assert "membership inference: loss_threshold: AUROC" in summary
    assert len(report["gradient_norms"]) == 2  # the two kernels
    assert all(name.endswith("/kernel") for name in report["gradient_norms"])
    plots = sorted(p.name for p in (tmp_path / run_dir).glob("*.png"))
    assert plots == ["accuracy_vs_epsilon.png", "certified_accuracy.png",
                     "gradient_norms.png", "tightness.png"]
    for p in (tmp_path / run_dir).glob("*.png"):
        p.unlink()
    assert cli.main(["report", run_dir]) == 0
    assert sorted(p.name for p in (tmp_path / run_dir).glob("*.png")) == plots
    assert cli.main(["report", str(tmp_path / "nothing")]) == 1


def test_documented_schema_matches_the_defaults():
    schema = cli._schema_help().split(":", 1)[1]
    assert yaml.safe_load(schema) == config.DEFAULT_CONFIG


def test_train_stops_at_the_budget(fake_fashion, tmp_path, capsys):
    path = write_yaml(tmp_path / "tiny.yaml", {
        "dataset": {"batch_size": 10, "nb_samples_train": 40},
        "model": {"widths": [8]},
        "privacy": {"epsilon_budget": 1.3},
        "training": {"epochs": 3, "bjorck_every": 2},  # 12 steps: epsilon 1.42; 9 fit in 1.3
        "certification": {"radii": [0.1]},
    })
    assert cli.main(["train", path]) == 0
    out = capsys.readouterr().out
    assert "that exceeds epsilon_budget=1.3: the accountant will stop training after 9 steps" in out
    summary = out.split("=== Summary ===")[1]
    assert "(3 epochs, 9 steps)" in summary
    eps = float(summary.split("(epsilon=")[1].split(",")[0])
    assert eps <= 1.3
    # not the last epoch's val_accuracy: fit refreshes the kernels after it (an audit)
    assert "(final weights, projected after the last epoch)" in summary
    rows = [line.split() for line in summary.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["radius", "0.1"]


@pytest.mark.parametrize("privacy, dataset, fragment", [
    # sigma x sensitivity below 2^-64: the step's noise check stops the first step
    ({"noise_multiplier": 1e-300}, {}, "0 steps taken, epsilon=0 spent at delta=1e-05): "
                                       "assertion failed: [lipdp: a noise stddev"),
    # inputs up to 1e30: noise of std ~1e27 overflows the bounds or turns weights to NaN
    ({}, {"input_bound": 1e30}, "steps taken, epsilon="),
])
def test_a_run_without_a_usable_model_exits_3_with_the_privacy_spent(fake_fashion, tmp_path,
                                                                       capsys, privacy, dataset,
                                                                       fragment):
    """Both used to end in a traceback with exit 1, the exit code of missing data (the second
    in the certificate's refusal of an infinite Lipschitz constant, after training)."""
    path = write_yaml(tmp_path / "tiny.yaml", {
        "dataset": {"batch_size": 10, "nb_samples_train": 40, **dataset},
        "model": {"widths": [8]},
        "privacy": {"epsilon_budget": None, **privacy},
        "training": {"epochs": 1},
    })
    assert cli.main(["train", path]) == 3
    err = capsys.readouterr().err
    assert err.startswith("lipdp: "), err
    assert fragment in err, err
    assert "Traceback" not in err


def test_a_fit_whose_weights_end_non_finite_stops_naming_them():
    """The second outcome of a diverging run: no check fails, but the weights are NaN."""
    from tests._models import mlp

    class Poison(tf.keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            kernel = self.model.layers[-1].kernel
            kernel.assign(tf.fill(kernel.shape, float("nan")))

    model = mlp(batch=8)
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.SGD(0.01))
    x = np.random.default_rng(0).normal(size=(64, 10)).astype("float32")
    y = tf.keras.utils.to_categorical(np.arange(64) % 3, 3)
    with pytest.raises(cli.TrainingStopped, match=r"training diverged \(8 steps taken, epsilon="
                       r"[0-9.]+ spent at delta=1e-05\): the weights of .*kernel.* hold NaN"):
        cli._fit_or_stop(model, x, y=y, batch_size=8, epochs=1, verbose=0, callbacks=[Poison()])


def test_train_scatternet_end_to_end(fake_fashion, tmp_path, capsys):
    cfg = load_config(None, [
        "dataset.batch_size=10", "dataset.nb_samples_train=40", "dataset.input_bound=28.0",
        "model.architecture=scatternet", "model.widths=[]", "model.scattering_angles=4",
        "model.scattering_order_weights=[0.5, 1.0, 4.0]", "model.feature_bound=2.0",
        "training.epochs=1", "privacy.epsilon_budget=null"])
    model, _, ds_test, metadata, _ = config.build_from_config(cfg)
    # The DP model is the head, on 7 x 7 x 25 scattering features (J = 2, 4 angles: 1 + 8 + 16
    # paths) bounded by feature_bound.
    assert metadata.input_shape == (7, 7, 25) and metadata.max_norm == 2.0
    assert [type(layer).__name__ for layer in model.layers] == [
        "DP_BoundedInput", "DP_Flatten", "DP_QuickSpectralDense"]
    network, images = config.certification_target(cfg, model, ds_test)
    front = network.layers[1]
    assert type(front).__name__ == "DP_Scattering" and network.input_shape == (None, 28, 28, 1)
    head_lip = float(lipschitz_bound(model))
    assert float(lipschitz_bound(network)) == pytest.approx(
        front.lipschitz_constant * head_lip, rel=1e-6)
    x, _ = next(iter(images))
    # The certified network computes on images what the head computes on their features.
    features = front(x)
    assert float(tf.reduce_max(tf.abs(network(x) - model(features)))) < 1e-5

    path = write_yaml(tmp_path / "scat.yaml", cfg)
    assert cli.main(["train", path]) == 0
    summary = capsys.readouterr().out.split("=== Summary ===")[1]
    assert "test accuracy" in summary and "sampler            : Poisson" in summary
    lip = float(summary.split("Lipschitz constant")[1].split(")")[0])
    assert lip == pytest.approx(front.lipschitz_constant * head_lip, rel=1e-3)
    assert "0.1412 (36/255)" in summary


def test_train_tanh_cnn_with_clipped_dpsgd(fake_fashion, tmp_path, capsys):
    """Papernot et al.'s tanh CNN, classic DP-SGD: plain Keras layers, clipping, no certificate;
    epsilon is the Poisson-subsampled Gaussian of the clipped mechanism."""
    from lipdp.accounting import compute_epsilon

    overrides = ["model.architecture=tanh_cnn", "privacy.mode=clipped",
                 "privacy.l2_norm_clip=0.5", "privacy.noise_multiplier=1.5",
                 "dataset.batch_size=20", "privacy.epsilon_budget=null", "training.epochs=2",
                 "loss.tau=1.0", "optimizer.name=sgd", "optimizer.learning_rate=1.0"]
    cfg = load_config(None, overrides)
    model, _, _, _, _ = config.build_from_config(cfg)
    conv = [(type(x).__name__, getattr(x, "filters", None), getattr(x, "kernel_size", None),
             getattr(x, "strides", None), getattr(x, "padding", None)) for x in model.layers]
    assert conv == [("Conv2D", 16, (8, 8), (2, 2), "same"), ("MaxPooling2D", None, None, (1, 1),
                     "valid"), ("Conv2D", 32, (4, 4), (2, 2), "valid"),
                    ("MaxPooling2D", None, None, (1, 1), "valid"),
                    ("Flatten", None, None, None, None), ("Dense", None, None, None, None),
                    ("Dense", None, None, None, None)]
    assert [model.layers[i].activation.__name__ for i in (0, 2, 5, 6)] == [
        "tanh", "tanh", "tanh", "linear"]
    assert model.dp_parameters.mode.value == "clipped" and model.dp_parameters.l2_norm_clip == 0.5

    path = write_yaml(tmp_path / "tanh.yaml", cfg)
    assert cli.main(["train", path]) == 0
    out = capsys.readouterr().out
    assert "clipped to L2 norm C = 0.5; noise std sigma C / D = 1.5 x 0.5 / 20 = 0.0375" in out
    summary = out.split("=== Summary ===")[1]
    assert "(2 epochs, 6 steps)" in summary and "clipped (flat), sigma=1.5" in summary
    eps = float(summary.split("(epsilon=")[1].split(",")[0])
    assert eps == pytest.approx(compute_epsilon(1.5, 20 / 60, 6, 1e-5), rel=1e-3)
    accuracy = float(summary.split("test accuracy      :")[1].split()[0])
    assert 0.0 <= accuracy <= 1.0
    assert "certified accuracy : none: no certified Lipschitz constant for conv2d" in summary


def test_scatternet_group_normalisation_is_per_example_and_not_certified(fake_fashion, tmp_path,
                                                                         capsys):
    cfg = load_config(None, [
        "dataset.batch_size=10", "dataset.nb_samples_train=40", "dataset.input_bound=28.0",
        "model.architecture=scatternet", "model.widths=[]", "model.feature_bound=63.0",
        "model.feature_normalization=group", "model.feature_groups=27",
        "training.epochs=1", "privacy.epsilon_budget=null"])
    front = config.build_front_end(cfg["model"], 28.0)
    x = tf.random.stateless_uniform([3, 28, 28, 1], seed=[4, 2])
    features = front(x).numpy()
    raw = front.layers[1](front.layers[0](x)).numpy()  # the scattering features
    groups = raw.reshape(3, 7 * 7, 27, 3).transpose(0, 2, 1, 3).reshape(3, 27, -1)
    expected = ((groups - groups.mean(-1, keepdims=True))
                / np.sqrt(groups.var(-1, keepdims=True) + 1e-5))  # Tramer & Boneh's GroupNorm
    expected = expected.reshape(3, 27, 7 * 7, 3).transpose(0, 2, 1, 3).reshape(features.shape)
    assert abs(features - expected).max() < 1e-3 * abs(expected).max()
    # Per example: an image's features do not depend on the other images of the batch.
    assert abs(front(x[:1]).numpy() - features[:1]).max() < 1e-5
    assert front.count_params() == 0

    path = write_yaml(tmp_path / "scat_gn.yaml", cfg)
    assert cli.main(["train", path]) == 0
    summary = capsys.readouterr().out.split("=== Summary ===")[1]
    assert ("certified accuracy : none: no certified Lipschitz constant for group_normalization"
            in summary)
    # Named as the model's fields, without Keras' dump of the call: they were reported as
    # the "dataset section" (an audit, 2026-12-07).
    for groups, reason in ((4, "Number of groups (4) must be a multiple of the number of "
                               "channels (81)"),
                           (100, "Number of groups (100) cannot be more than the number of "
                                 "channels (81)")):
        with pytest.raises(ConfigError) as refused:
            config.build_from_config(load_config(path, [f"model.feature_groups={groups}"]))
        assert str(refused.value) == (
            "The scattering front end (model.scattering_J, model.scattering_angles, "
            "model.feature_groups) does not fit fashion_mnist's images of shape (28, 28, 1): "
            f"{reason}.")


def test_multiscale_scatternet_concatenates_each_scale_normalised_alone(fake_fashion, tmp_path,
                                                                         capsys):
    """``scattering_J: [2, 1]``: the J = 2 features exactly as the single-scale front end
    computes them, then the J = 1 scattering (9 paths of 14 x 14, orders 0 and 1) normalised by
    its own groups, per example; trained end to end by `lipdp train`, not certified."""
    cfg = load_config(None, [
        "dataset.batch_size=10", "dataset.nb_samples_train=40", "dataset.input_bound=28.0",
        "model.architecture=scatternet", "model.head=plain", "model.widths=[]",
        "model.feature_bound=76.0", "model.feature_normalization=group",
        "model.scattering_J=[2, 1]", "model.feature_groups=[27, 3]", "privacy.mode=clipped",
        "privacy.l2_norm_clip=0.1", "loss.tau=1.0", "optimizer.name=sgd",
        "training.epochs=1", "privacy.epsilon_budget=null"])
    front = config.build_front_end(cfg["model"], 28.0)
    x = tf.random.stateless_uniform([3, 28, 28, 1], seed=[4, 3])
    features = front(x).numpy()
    assert features.shape == (3, 81 * 7 * 7 + 9 * 14 * 14) and front.count_params() == 0
    single = config.build_front_end({**cfg["model"], "scattering_J": 2, "feature_groups": 27},
                                    28.0)
    np.testing.assert_array_equal(features[:, :81 * 7 * 7], single(x).numpy().reshape(3, -1))
    from lipdp import layers

    fine = layers.DP_Scattering(J=1, max_order=1, order_weights=(1.0, 1.0))(
        layers.DP_BoundedInput(28.0)(x)).numpy()  # (3, 14, 14, 9)
    groups = fine.reshape(3, 14 * 14, 3, 3).transpose(0, 2, 1, 3).reshape(3, 3, -1)
    expected = ((groups - groups.mean(-1, keepdims=True))
                / np.sqrt(groups.var(-1, keepdims=True) + 1e-5))
    expected = expected.reshape(3, 3, 14 * 14, 3).transpose(0, 2, 1, 3).reshape(3, -1)
    assert abs(features[:, 81 * 7 * 7:] - expected).max() < 1e-3 * abs(expected).max()
    assert abs(front(x[:1]).numpy() - features[:1]).max() < 1e-5  # per example

    path = write_yaml(tmp_path / "scat_multi.yaml", cfg)
    assert cli.main(["train", path]) == 0
    summary = capsys.readouterr().out.split("=== Summary ===")[1]
    assert "certified accuracy : none: no certified Lipschitz constant for" in summary
    for overrides, message in [(["model.feature_normalization=none"], "group normalisation"),
                               (["model.feature_groups=27"], "one group count per scale"),
                               (["model.scattering_J=[2, 2]"], "distinct"),
                               (["model.scattering_J=2"], "a list only when")]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, overrides)


def test_certified_multiscale_scatternet_trains_and_certifies_in_pixel_space(fake_fashion,
                                                                               tmp_path, capsys):
    """``scattering_J: [2, 1]`` without normalisation: one `DP_MultiscaleScattering` (its
    constant the root of the sum of the scales' squared constants, the scale weights
    folded into each scale's order weights) before the Lipschitz head; `lipdp train`
    certifies radii through front end + head; scale weights need a list of scales and no
    group normalisation."""
    cfg = load_config(None, [
        "dataset.batch_size=10", "dataset.nb_samples_train=40", "dataset.input_bound=28.0",
        "model.architecture=scatternet", "model.widths=[]", "model.use_bias=true",
        "model.scattering_J=[2, 1]", "model.scattering_order_weights=[0.3, 1.0, 4.0]",
        "model.scattering_scale_weights=[1.0, 0.5]", "model.scattering_padding=zero",
        "model.scattering_angles=4", "privacy.mode=clipped", "privacy.l2_norm_clip=1.0",
        "training.epochs=1", "privacy.epsilon_budget=null"])
    front = config.build_front_end(cfg["model"], 28.0)
    from lipdp import layers

    assert isinstance(front.layers[1], layers.DP_MultiscaleScattering)
    x = tf.random.stateless_uniform([2, 28, 28, 1], seed=[5, 3])
    features = front(x).numpy()
    assert features.shape == (2, 25 * 7 * 7 + 5 * 14 * 14)  # 4 angles: 25 and 5 paths
    fine = layers.DP_Scattering(J=1, angles=4, max_order=1, order_weights=(0.15, 0.5),
                                padding="zero")
    np.testing.assert_array_equal(features[:, 25 * 7 * 7:], fine(x).numpy().reshape(2, -1))
    coarse, fine_constant = (s.lipschitz_constant for s in front.layers[1].scatterings)
    assert fine_constant == pytest.approx(fine.lipschitz_constant)
    assert front.layers[1].lipschitz_constant == pytest.approx(np.hypot(coarse, fine_constant))

    path = write_yaml(tmp_path / "scat_multi_certified.yaml", cfg)
    assert cli.main(["train", path]) == 0
    summary = capsys.readouterr().out.split("=== Summary ===")[1]
    assert "certified accuracy" in summary and "none:" not in summary
    for overrides, message in [(["model.scattering_J=2"], "scale_weights"),
                               (["model.scattering_scale_weights=[1.0]"], "scale_weights"),
                               (["model.feature_normalization=group",
                                 "model.feature_groups=[27, 3]"], "scale_weights"),
                               (["model.scattering_scale_weights=[1.0, -1.0]"], "positive")]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, overrides)


def test_data_command_and_a_quiet_console(tmp_path):
    """`lipdp data NAME` checks a dataset; the `lipdp` command (and ``python -m lipdp.cli``)
    prints lipdp's lines only: no TensorFlow start-up log (CUDA, cuDNN, TensorRT, CPU
    features) unless the user sets TF_CPP_MIN_LOG_LEVEL, and no runpy warning."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(sys.executable), "lipdp")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([script, "data", "digits"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("lipdp: digits found: scikit-learn") and done.stderr == ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    module = subprocess.run([sys.executable, "-m", "lipdp.cli", "data", "digits"],
                            capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                            env={**env, "PYTHONPATH": root})
    assert module.returncode == 0 and module.stderr == "", module.stderr
    loud = subprocess.run([script, "data", "digits"], capture_output=True, text=True,
                          env={**env, "TF_CPP_MIN_LOG_LEVEL": "0"}, timeout=120,
                          cwd=str(tmp_path))
    assert loud.returncode == 0 and "tensorflow" in loud.stderr  # the user's setting wins
    verbose = subprocess.run([script, "train", "--help", "--verbose"], capture_output=True,
                             text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert verbose.returncode == 0 and "tensorflow" in verbose.stderr
    assert cli.main(["data", "breast_cancer"]) == 0
    assert cli.main(["data", "nosuchdata"]) == 2


@pytest.mark.parametrize("bound", ["clip", "normalize"])
def test_binary_dataset_reports_auroc(no_download, tmp_path, capsys, bound):
    """Also: the radii's space as it is. With ``bound: normalize`` the pipeline scales each
    input to the bound outside the certified network; the summary said "input space", and
    an audit flipped 55 of 60 examples certified beyond 0.5 by raw-input perturbations of
    norm 0.5 (the scaling stretches distances by up to X0 / ||x||)."""
    path = write_yaml(tmp_path / "bc.yaml", {
        "dataset": {"name": "breast_cancer", "batch_size": 100, "input_bound": 2.5, "seed": 0,
                    "bound": bound},
        "model": {"widths": [], "use_bias": True},
        "privacy": {"epsilon_budget": None}, "training": {"epochs": 2},
        "certification": {"radii": [0.0, 0.1]}})
    assert cli.main(["train", path]) == 0
    summary = capsys.readouterr().out.split("=== Summary ===")[1]
    label = summary.split("certified accuracy : ")[1].splitlines()[0]
    assert label.startswith("L2 radius in " + ("input space" if bound == "clip" else
                                               "the space of the normalised inputs")), label
    auroc = float(summary.split("test AUROC")[1].split(":")[1].split()[0])
    assert 0.0 <= auroc <= 1.0


def test_sweep_records_every_grid_point(fake_fashion, tmp_path, capsys):
    path = write_yaml(tmp_path / "tiny.yaml", {
        "dataset": {"batch_size": 10, "nb_samples_train": 40},
        "model": {"widths": [8]}, "privacy": {"epsilon_budget": None},
        "training": {"epochs": 1}, "certification": {"radii": [0.0, 0.1]}})
    output = tmp_path / "runs.jsonl"
    assert cli.main(["sweep", path, "--grid", "dataset.seed=[0, 1]", "--grid",
                     "optimizer.learning_rate=[0.01]", "--set", "loss.tau=5",
                     "--output", str(output)]) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["grid_point"] for r in rows] == [
        ["dataset.seed=0", "optimizer.learning_rate=0.01"],
        ["dataset.seed=1", "optimizer.learning_rate=0.01"]]
    for seed, row in enumerate(rows):
        assert row["config"]["dataset"]["seed"] == seed and row["config"]["loss"]["tau"] == 5
        assert row["steps"] == 4 and row["test_auroc"] is None
        assert 0 <= row["certified_accuracy"]["0.1"] <= row["test_accuracy"] <= 1
    out = capsys.readouterr().out
    assert "Sweep: 2 runs" in out and "test_accuracy: mean" in out
    assert "releasing the best of these runs spends more, whatever scores choose it" in out
    assert cli.main(["sweep", path, "--grid", "dataset.seed=3", "--output",
                     str(output)]) == 2  # not a list
    assert "expected section.field=[v1, v2, ...]" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(REPO, "configs"))
                                        if f.endswith(".yaml")))
def test_every_shipped_config_is_valid(name):
    cfg = load_config(os.path.join(REPO, "configs", name))
    # Every shipped row states its budget and samples as the accountant assumes.
    assert cfg["privacy"]["epsilon_budget"] is not None
    assert cfg["dataset"]["sampling"] == "poisson"


@pytest.mark.parametrize("name", ["fashion_mnist_eps1.yaml", "fashion_mnist_eps8.yaml",
                                  "mnist.yaml"])
def test_configs_that_mirror_the_main_job_build_its_model(name):
    """The configs whose header says they take the main job's settings build its model, the
    Björck iterations included (they kept deel-lip's loop after the main job moved to one)."""
    main = load_config(os.path.join(REPO, "configs", "fashion_mnist.yaml"))
    cfg = load_config(os.path.join(REPO, "configs", name))
    with open(os.path.join(REPO, "configs", name)) as source:
        header = " ".join(line.lstrip("# ").strip() for line in source.read(300).splitlines())
    assert "the main job's settings" in header
    assert cfg["model"] == main["model"]
    for section in ("dataset", "loss", "optimizer"):
        different = {k for k in main[section] if cfg[section].get(k) != main[section][k]}
        assert different <= {"name"}, (section, different)
    assert cfg["training"]["bjorck_every"] == main["training"]["bjorck_every"]


def test_scattering_angles_reach_every_scattering_layer_and_the_feature_cache(fake_fashion):
    """``model.scattering_angles`` (kymatio's L, default 8) builds every scattering of the
    single, certified multiscale and normalised multiscale front ends; the features cached
    for one setting are not served to another (they have 1 + 2 L + L^2 paths at J = 2)."""
    from lipdp import layers

    assert load_config(None)["model"]["scattering_angles"] == 8
    cfg = load_config(None, ["model.architecture=scatternet", "model.scattering_angles=4"])
    assert config.build_front_end(cfg["model"], 28.0).layers[1].angles == 4
    certified = config.build_front_end({**cfg["model"], "scattering_J": [2, 1]}, 28.0)
    assert isinstance(certified.layers[1], layers.DP_MultiscaleScattering)
    assert [s.angles for s in certified.layers[1].scatterings] == [4, 4]
    grouped = config.build_front_end({**cfg["model"], "scattering_J": [2, 1],
                                      "feature_groups": [5, 5],
                                      "feature_normalization": "group"}, 28.0)
    assert [branch[0].angles for branch in grouped.branches] == [4, 4]
    for bad in ["0", "2.5", "four"]:
        with pytest.raises(ConfigError, match="scattering_angles"):
            load_config(None, [f"model.scattering_angles={bad}"])
    shapes = []
    for angles in (8, 4, 8):
        small = load_config(None, ["dataset.batch_size=10", "dataset.nb_samples_train=40",
                                   "model.architecture=scatternet", "model.widths=[]",
                                   f"model.scattering_angles={angles}",
                                   "privacy.epsilon_budget=null", "training.epochs=1"])
        _, ds_train, _, metadata, _ = config.build_from_config(small)
        shapes.append((metadata.input_shape, next(iter(ds_train))[0].shape[1:]))
    assert shapes == [((7, 7, 81), (7, 7, 81)), ((7, 7, 25), (7, 7, 25)),
                      ((7, 7, 81), (7, 7, 81))]


def test_scattering_padding_reaches_every_scattering_layer_and_its_constant():
    """``model.scattering_padding: zero`` builds zero-padded scatterings (single and multiscale
    front ends): half the reflection constant on 28 x 28; anything else is a ConfigError."""
    cfg = load_config(None, ["model.architecture=scatternet", "model.scattering_padding=zero"])
    front = config.build_front_end(cfg["model"], 28.0)
    front(tf.zeros([1, 28, 28, 1]))
    reflect = config.build_front_end({**cfg["model"], "scattering_padding": "reflect"}, 28.0)
    reflect(tf.zeros([1, 28, 28, 1]))
    zero_layer, reflect_layer = front.layers[1], reflect.layers[1]
    assert zero_layer.padding == "zero" and reflect_layer.padding == "reflect"
    assert zero_layer.lipschitz_constant == pytest.approx(reflect_layer.lipschitz_constant / 2)
    multi = config.build_front_end({**cfg["model"], "scattering_J": [2, 1],
                                    "feature_groups": [27, 3], "feature_normalization": "group"},
                                   28.0)
    assert all(branch[0].padding == "zero" for branch in multi.branches)
    with pytest.raises(ConfigError, match="scattering_padding"):
        load_config(None, ["model.scattering_padding=circular"])


def test_a_new_run_in_the_folder_of_a_killed_run_is_refused(fake_fashion, tmp_path,
                                                             monkeypatch, capsys):
    """`lipdp train EDITED.yaml --run-dir RUN` where RUN holds a killed run's checkpoint wrote
    its config over the killed run's, then stopped on the restored ledger's mismatch,
    naming "None/config.json" (a review, 2026-12-07). Refused before anything is written,
    pointing to --resume; the killed run then resumes. A finished run's folder is not
    refused."""
    from lipdp import checkpoints

    cfg = {"dataset": {"name": "fashion_mnist", "batch_size": 10, "nb_samples_train": 40,
                       "input_bound": 10.0, "seed": 0},
           "model": {"architecture": "mlp", "widths": [8]},
           "privacy": {"noise_multiplier": 3.0, "delta": 1e-5, "epsilon_budget": None},
           "training": {"epochs": 2}, "certification": {"radii": [0.0]}}
    first = write_yaml(tmp_path / "first.yaml", cfg)
    cfg["privacy"]["noise_multiplier"] = 20.0
    edited = write_yaml(tmp_path / "edited.yaml", cfg)
    run_dir = str(tmp_path / "run")
    backup = checkpoints.BackupAndRestore.on_epoch_end

    def killed(self, epoch, logs=None):
        backup(self, epoch, logs)
        raise KeyboardInterrupt("killed after the first epoch's checkpoint")

    monkeypatch.setattr(checkpoints.BackupAndRestore, "on_epoch_end", killed)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["train", first, "--run-dir", run_dir])
    monkeypatch.setattr(checkpoints.BackupAndRestore, "on_epoch_end", backup)
    config_path = os.path.join(run_dir, cli.CONFIG_FILE)
    original = open(config_path).read()
    capsys.readouterr()
    assert cli.main(["train", edited, "--run-dir", run_dir]) == cli.EXIT_CONFIG
    assert f"holds a killed run (its checkpoint): resume it with 'lipdp train --resume " \
        f"{run_dir}'" in capsys.readouterr().err
    assert open(config_path).read() == original
    # A resume of a run folder whose config's model was edited: Keras' restore error with a
    # traceback before (an audit, 2026-12-07).
    edited_run = json.loads(original)
    edited_run["model"]["widths"] = [16]
    with open(config_path, "w") as f:
        json.dump(edited_run, f)
    assert cli.main(["train", "--resume", run_dir]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "is not the config of the run its checkpoint holds" in err and \
        "is not of this model" in err and "Traceback" not in err
    with open(config_path, "w") as f:
        f.write(original)
    assert cli.main(["train", "--resume", run_dir]) == 0
    out = capsys.readouterr().out
    assert "(2 epochs, 8 steps; the time of the last process that trained" in out
    # A kill between report.json and the removal of trained/ leaves a finished run, which
    # --resume declines: a new run there is not refused (a review).
    os.makedirs(os.path.join(run_dir, cli.TRAINED_DIR))
    assert cli.main(["train", "--resume", run_dir]) == cli.EXIT_CONFIG
    assert cli.main(["train", first, "--run-dir", run_dir]) == 0


def test_more_steps_than_the_accountant_counts_is_a_config_error(fake_fashion, tmp_path, capsys):
    """The accountant's ValueError came with a traceback, exit code 1 (an audit)."""
    path = write_yaml(tmp_path / "c.yaml", {
        "dataset": {"name": "fashion_mnist", "batch_size": 10, "nb_samples_train": 40,
                    "input_bound": 10.0},
        "model": {"architecture": "mlp", "widths": [8]},
        "privacy": {"epsilon_budget": None}, "training": {"epochs": 2**61}})
    assert cli.main(["train", path, "--run-dir", str(tmp_path / "run")]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"training.epochs={2**61} makes {2**63} steps of 4 an epoch" in err
    assert "Traceback" not in err


def test_a_run_killed_after_its_training_is_completed_by_resume_without_training(
        fake_fashion, tmp_path, monkeypatch, capsys):
    """A run killed after its training ended -- while it certified, saved or wrote its
    report -- had lost its checkpoint (deleted at the end of fit), and `--resume` told the
    user to start it again: a second model trained on the same records, each run reporting
    one run's epsilon (an audit). The trained weights and ledger are kept until report.json
    exists, and a resume completes the run from them without a step. On a terminal, a run
    with adaptive clipping prints no per-step progress bar: it showed each step's C_t, of
    steps a resume would discard from the ledger."""
    import sys

    path = write_yaml(tmp_path / "tiny.yaml", {
        "dataset": {"name": "fashion_mnist", "batch_size": 10, "nb_samples_train": 40,
                    "input_bound": 10.0, "seed": 0},
        "model": {"architecture": "mlp", "widths": [8]},
        "privacy": {"noise_multiplier": 3.0, "delta": 1e-5, "epsilon_budget": None,
                    "adaptive_clip_quantile": 0.5, "adaptive_clip_noise": 10.0},
        "training": {"epochs": 2},
        "certification": {"radii": [0.0]},
    })
    run_dir = str(tmp_path / "run")
    write_run = cli._write_run

    def killed(*args, **kwargs):
        raise RuntimeError("killed while writing the report")

    monkeypatch.setattr(cli, "_write_run", killed)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    with pytest.raises(RuntimeError, match="killed"):
        cli.main(["train", path, "--run-dir", run_dir])
    first = capsys.readouterr().out
    assert "Epoch 2/2" in first and "logit_clip" in first and "[=" not in first
    privacy = first.split("privacy            : ")[1].split("\n")[0]
    monkeypatch.setattr(cli, "_write_run", write_run)
    # Its config edited (sigma 3 -> 20): the report gave sigma 20 beside the ledger's epsilon
    # of sigma 3 (an audit, 2026-12-07); refused as an invalid config, without a traceback.
    config_path = os.path.join(run_dir, cli.CONFIG_FILE)
    original = open(config_path).read()
    edited = json.loads(original)
    edited["privacy"]["noise_multiplier"] = 20.0
    with open(config_path, "w") as f:
        json.dump(edited, f)
    assert cli.main(["train", "--resume", run_dir]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "is not the config of the run its checkpoint holds" in err
    assert "noise_multiplier: 3.0 in the ledger, 20.0 now" in err
    assert not os.path.exists(os.path.join(run_dir, "report.json"))
    with open(config_path, "w") as f:
        f.write(original)
    assert cli.main(["train", "--resume", run_dir]) == 0
    out = capsys.readouterr().out
    assert "training had finished (8 steps)" in out and "no step is taken again" in out
    assert "(2 epochs, 8 steps; the time of the last process that trained: the run was " \
        "resumed)" in out
    assert "Epoch 1/" not in out and f"privacy            : {privacy}" in out
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["results"]["steps"] == 8
    assert report["per_epoch"]["epoch"] == [1, 2] and len(report["per_epoch"]["epsilon"]) == 2
    assert not os.path.exists(os.path.join(run_dir, cli.TRAINED_DIR))
