"""tf.distribute: the noise of a distributed private step, and Poisson sampling across
replicas and workers.

The strategies run in subprocesses (`tests/_distributed.py`): a MirroredStrategy over
2 logical CPU devices, and 2 worker processes on 127.0.0.1 under
MultiWorkerMirroredStrategy.

The noise test. On all-zero inputs with learning rate 0, every kernel's gradient is
exactly 0, so the gradient the optimizer applies (recorded after the replicas'
gradients are summed) is the noise alone. With z = applied gradient / (the
single-device noise std of DESIGN.md's closed forms), ``T = sum z^2`` over n = 2080
kernel coordinates (20 steps) is chi-square with n degrees of freedom when the std is
right: T/n has mean 1 and standard deviation sqrt(2/n) = 0.031. The test accepts
|T/n - 1| < 4 sqrt(2/n) = 0.124: a false alarm has probability 6e-5 (normal
approximation; the draws are seeded, so the outcome is fixed). Noise added at full
scale by each of the 2 replicas gives T/n = 2, noise split in halves 0.5, and the
1.22x std once measured here T/n = 1.49: each is more than 15 standard deviations
away (power 1 - 1e-50). Reverting lipdp's once-per-global-batch noise gives T/n = 1.94.
"""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.data import BatchSampler, _poisson_pipeline
from lipdp.metadata import Sampling
from tests import _distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = list(_distributed.CONFIGS)


def _last_json_line(output: str):
    return json.loads(output.strip().splitlines()[-1])


def _run(args, env=None, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "tests._distributed", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process, timeout):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"distributed run timed out after {timeout} s:\n{err[-3000:]}")
    assert process.returncode == 0, err[-5000:]
    return _last_json_line(out)


@pytest.fixture(autouse=True)
def _draws_of_this_test_only(monkeypatch):
    """Each test starts as a new process would: `lipdp.data.reserved_draws` counts every
    Poisson pipeline the process built, and other tests' pipelines would raise a
    train_on_batch's draw mark past the draws these tests name."""
    monkeypatch.setattr(lipdp.data, "_EVERY_NEXT_STEP", [])


@pytest.fixture(scope="module")
def mirrored():
    return _finish(_run(["mirrored"]), timeout=400)


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes on 127.0.0.1, each training one model per mode in turn."""
    ports = _free_ports(2)
    spec = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    processes = [_run(["worker"], env={"TF_CONFIG": json.dumps(
        {"cluster": spec, "task": {"type": "worker", "index": index}})}) for index in range(2)]
    try:
        # Both pipes are drained at once. Read one after the other, the second worker sat
        # blocked writing its result (over 64 KiB) into a full pipe until the first ended;
        # under a sampling profiler (py-spy, which pauses processes) that result arrived cut
        # at 65536 characters and the fixture failed.
        with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
            return list(pool.map(lambda process: _finish(process, timeout=300), processes))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


@pytest.fixture(params=_distributed.MODES)
def workers(request, cluster):
    """Both workers' results for one mode."""
    return [results[request.param] for results in cluster]


# ----------------------------------------------------------------- the noise
@pytest.mark.parametrize("config", CONFIGS)
def test_noise_free_update_equals_single_device(mirrored, config):
    result = mirrored[config]
    assert result["gradient_diff"] < 1e-6  # float32 sums in another order
    assert result["weights_diff"] < 1e-5   # after 8 steps at learning rate 0.5


@pytest.mark.parametrize("config", CONFIGS)
def test_aggregated_noise_has_the_single_device_std(mirrored, config):
    result = mirrored[config]
    tolerance = 4 * np.sqrt(2 / result["n"])
    assert result["steps"] == 20
    assert abs(result["single_ratio"] - 1) < tolerance  # the statistic itself is calibrated
    assert abs(result["replicated_ratio"] - 1) < tolerance, result


def test_a_global_batch_larger_than_declared_is_refused_under_the_strategy(mirrored):
    """Shuffled batches of 16 declared, global batches of 32 given (each replica 16): the
    step compares the global batch, summed over replicas, and fails before the first step
    (it compared each replica's share, and 2 replicas trained at twice the declared rate)."""
    result = mirrored["oversized"]
    assert result["error"] is not None and "larger than dataset_metadata.batch_size" in \
        result["error"], result
    assert result["steps"] == 0


def test_state_written_after_a_warm_up_is_put_back_under_the_strategy(mirrored):
    """`lipdp.state_guard` under MirroredStrategy: each replica puts the value its batch
    wrote back before the step fails (the layer's own write works in replica context, and so
    does the guard's); two steps counted, as on one device."""
    result = mirrored["warmed_state"]
    assert result["error"] is not None and "warmed/largest:0" in result["error"], result
    assert result["largest"] == 0.0 and result["steps"] == 2, result


def test_adaptive_clipping_counts_over_the_global_batch(mirrored):
    """`lipdp.AdaptiveClipping` under the strategy: the replicas' counts are summed and the
    count's noise is drawn once. Noise-free, C_t after 8 steps equals the single-device
    run's; with sigma_b = 2 the noise recovered from 100 updates of C_t has the
    single-device variance: mean(n^2) / sigma_b^2 within 4 sqrt(2/100) = 0.57 of 1
    (a count noised on each of the 2 replicas gives 2, 7 standard deviations away)."""
    result = mirrored["adaptive"]
    assert result["clip_replicated"] == pytest.approx(result["clip_single"], rel=1e-5)
    assert result["clip_single"] != 0.5  # it moved
    assert result["weights_diff"] < 1e-5
    tolerance = 4 * np.sqrt(2 / result["n"])
    assert abs(result["count_single_ratio"] - 1) < tolerance
    assert abs(result["count_replicated_ratio"] - 1) < tolerance, result


# ------------------------------------------------------------------- sampling
def _check_sampler(reference, pieces_per_step):
    """Each step's pieces (one per replica) are disjoint and make up the global draw, and
    the global draws include each example with frequency q.

    The inclusion count K over N x steps = 80000 (example, step) pairs is Binomial(80000,
    q = 0.05) when the sampler is right: mean 4000, sd 61.6; the test accepts
    |K - 4000| < 4 sd (false alarm 6e-5). A rate 10% off (q = 0.055) moves the mean by 400,
    6.5 sd: detected with probability 0.99."""
    assert len(reference) == len(pieces_per_step) == _distributed.STEPS_SAMPLER
    for drawn, pieces in zip(reference, pieces_per_step):
        merged = [i for piece in pieces for i in piece]
        assert len(merged) == len(set(merged)), "an example in two replicas' batches"
        assert sorted(merged) == drawn
    n, q, steps = _distributed.N_SAMPLER, _distributed.Q_SAMPLER, _distributed.STEPS_SAMPLER
    count = sum(len(drawn) for drawn in reference)
    sd = np.sqrt(n * steps * q * (1 - q))
    assert abs(count - n * steps * q) < 4 * sd, (count, n * steps * q, sd)


def test_poisson_batches_split_across_replicas(mirrored):
    sampler = mirrored["sampler"]
    assert max(len(p) for p in sampler["pieces"]) == 2
    _check_sampler(sampler["reference"], sampler["pieces"])


def test_poisson_batches_split_across_workers(workers):
    first, second = workers
    assert first["sampler"]["reference"] == second["sampler"]["reference"]
    pieces = [a + b for a, b in zip(first["sampler"]["pieces"], second["sampler"]["pieces"])]
    _check_sampler(first["sampler"]["reference"], pieces)


# --------------------------------------------------------------- multi-worker
def test_workers_end_with_identical_weights_and_ledger(workers):
    first, second = workers
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert first["ledger"] == second["ledger"]
    assert first["steps"] == second["steps"] == 2 * first["steps_per_epoch"]
    assert first["sampler_next_step"] == first["steps"]
    # The ledger records one mechanism of the global batch: the accountant is unchanged.
    mechanism = lipdp.ledger.StepMechanism.from_row(first["ledger"][0][1:])
    assert mechanism.batch_size == 128
    expected = lipdp.accounting.compute_epsilon(mechanism.step_noise_multiplier,
                                                mechanism.sampling_rate, first["steps"], 1e-5)
    assert first["epsilon"] == second["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_workers_refuse_a_pipeline_without_a_common_seed(workers):
    """Unseeded pipelines, and pipelines seeded 3 and 4 (per-worker randomness: each worker
    trained on its share of its own global draw, one example in both shares in 5% of the
    steps; found by an audit): refused on every worker, which compare digests of their
    samplers before any of them refuses."""
    for worker in workers:
        assert "same S on every worker" in worker["unseeded_refused"]
        assert "pipelines differ" in worker["own_seeds_refused"]
        assert "pipelines differ" in worker["other_data_refused"]  # same seed, other records


# ------------------------------------------------- the sampler's step counter
def _index_pipeline(sampler, steps=6, n=50, q=0.2):
    x = tf.range(n, dtype=tf.float32)[:, None]
    return _poisson_pipeline(x, tf.range(n), steps, q, sampler, lambda a, b: (a, b))


def _draws(dataset):
    return [b[1].numpy().tolist() for b in dataset]


def test_poisson_draw_of_a_step_depends_on_seed_and_step_only():
    import gc

    first = BatchSampler(Sampling.POISSON, 5)
    epochs = _draws(_index_pipeline(first)) + _draws(_index_pipeline(first))
    assert int(first.next_step.numpy()) == 12
    assert epochs[:6] != epochs[6:]  # the second pass continues the sequence
    alongside = BatchSampler(Sampling.POISSON, 5)
    alongside.start_at(6)  # shares the live counter of seed 5, which never goes back
    assert int(alongside.next_step.numpy()) == 12
    del first, alongside
    gc.collect()
    resumed = BatchSampler(Sampling.POISSON, 5)  # as in another process
    resumed.start_at(6)
    assert _draws(_index_pipeline(resumed)) == epochs[6:]
    other_seed = BatchSampler(Sampling.POISSON, 6)
    assert _draws(_index_pipeline(other_seed)) != epochs[:6]


def test_fit_continues_the_sampler_at_the_model_step(tmp_path):
    """A new pipeline with the same seed, given to a model that already took steps, draws
    the batches of the following steps: never again those of the first epoch."""
    ds, _, metadata = lipdp.data.load_dataset("digits", 256, bound_clip_value=8.0, seed=1)
    model = _digits_model(metadata)
    model.fit(ds, epochs=1, verbose=0)
    steps = model.dp_steps_taken
    assert steps == metadata.steps_per_epoch
    again, _, _ = lipdp.data.load_dataset("digits", 256, bound_clip_value=8.0, seed=1)
    model.fit(again, epochs=1, verbose=0)
    assert int(again.lipdp_sampler.next_step.numpy()) == 2 * steps


def test_train_on_batch_warns_when_a_seeded_pipeline_would_replay_earlier_draws():
    """A resumed custom loop: a model that took a first epoch's steps, then train_on_batch on
    a new pipeline of the same explicit seed once the first is gone (as in a new process),
    not started at the model's step (fit starts it): its batches are the first epoch's again
    (measured by an audit: epsilon 4.26 reported against 5.89 for what ran).
    train_on_batch cannot see the pipeline; it warns, once, naming the call that aligns it
    (to `poisson_draws_until`: the loop's draws went up to 11); after that call the draws
    are new ones and no warning comes. While a pipeline of the
    seed lives, a new one continues its draws (they share one counter): no replay, no
    warning."""
    import gc
    import warnings

    ds, _, metadata = lipdp.data.load_dataset("digits", 256, bound_clip_value=8.0, seed=3)
    model = _digits_model(metadata)
    model.fit(ds, epochs=1, verbose=0)
    assert id(ds.lipdp_sampler) in model._samplers_seen
    alongside, _, _ = lipdp.data.load_dataset("digits", 256, bound_clip_value=8.0, seed=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for x, y in alongside.take(2):
            model.train_on_batch(x, y)
    assert not [w for w in record if "seed 3 draws from step" in str(w.message)]
    assert alongside.lipdp_sampler.last_pass_start() == 6  # after fit's draws 0..5
    del ds, alongside
    gc.collect()
    again, _, _ = lipdp.data.load_dataset("digits", 256, bound_clip_value=8.0, seed=3)
    with pytest.warns(UserWarning, match=r"seed 3 draws from step 0, while this model's "
                                         r"steps may have used its draws up to step 11.*"
                                         r"start_at\(model.poisson_draws_until\)") as record:
        for x, y in again.take(3):
            model.train_on_batch(x, y)
    assert sum("seed 3 draws from step 0" in str(w.message) for w in record) == 1
    del again
    gc.collect()
    aligned, _, _ = lipdp.data.load_dataset("digits", 256, bound_clip_value=8.0, seed=3)
    aligned.lipdp_sampler.start_at(model.poisson_draws_until)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for x, y in aligned.take(2):
            model.train_on_batch(x, y)
    assert not [w for w in record if "draws from step" in str(w.message)]


def _digits_model(metadata):
    from lipdp.layers import DP_BoundedInput, DP_QuickSpectralDense

    model = lipdp.DP_Sequential([DP_BoundedInput(8.0, input_shape=(64,)),
                                 DP_QuickSpectralDense(10)],
                                dp_parameters=lipdp.DPParameters(1.0, 1e-5),
                                dataset_metadata=metadata)
    model.compile(optimizer="sgd", loss=lipdp.losses.DP_TauCategoricalCrossentropy(8.0))
    return model


def test_poisson_pipeline_refuses_a_strategy_scope():
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(RuntimeError, match="outside `strategy.scope"):
            lipdp.data.load_dataset("digits", 256, bound_clip_value=8.0)
