"""What every architecture example shares: arguments, data, private training, report.

Each example trains one `lipdp.zoo` architecture on Fashion-MNIST with Clipless
DP-SGD, stops at the epsilon budget, and prints (epsilon, delta), the test
accuracy, the certified accuracy at a few L2 radii, and how tight the gradient
bounds were on a test batch (`lipdp.bounds.tightness`; on training data that report
would not be covered by epsilon). Training is compiled with ``private_logs_only``:
the per-epoch lines show epsilon and validation metrics, nothing computed on
training data outside the noisy gradient.
"""

import argparse
import time

import tensorflow as tf

import lipdp


def parse_args(description, **defaults):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=defaults.get("epochs", 5),
                        help="at most this many epochs (fewer if the budget runs out)")
    parser.add_argument("--epsilon", type=float, default=3.0, help="privacy budget (delta=1e-5)")
    parser.add_argument("--noise", type=float, default=defaults.get("noise", 3.0),
                        help="noise multiplier sigma")
    parser.add_argument("--batch-size", type=int, default=defaults.get("batch_size", 5000),
                        help="expected Poisson batch size")
    parser.add_argument("--input-bound", type=float, default=defaults.get("input_bound", 10.0),
                        help="L2 bound the inputs are clipped to")
    parser.add_argument("--lr", type=float, default=defaults.get("lr", 1e-3))
    parser.add_argument("--tau", type=float, default=defaults.get("tau", 10.0),
                        help="temperature of the cross-entropy")
    parser.add_argument("--bound-fraction", type=float, default=None,
                        help="classic DP-SGD instead: clip each variable's per-example gradient "
                             "at this fraction of its analytic bound at initialisation "
                             "(lipdp.bounds.bound_fraction_thresholds; mixed ghost norms)")
    parser.add_argument("--train-examples", type=int, default=None,
                        help="train on the first n examples only (quick runs)")
    parser.add_argument("--data-dir", default=None)
    return parser.parse_args()


def run(args, build, name):
    """Trains `build(metadata)` privately and prints the report."""
    ds_train, ds_test, metadata = lipdp.data.load_dataset(
        "fashion_mnist", args.batch_size, bound_clip_value=args.input_bound, sampling="poisson",
        data_dir=args.data_dir, nb_samples_train=args.train_examples)  # a secret seed
    dp_parameters = lipdp.DPParameters(noise_multiplier=args.noise, delta=1e-5)
    model = build(dp_parameters, metadata)
    loss = lipdp.losses.DP_TauCategoricalCrossentropy(args.tau)
    algorithm = "Clipless DP-SGD"
    if args.bound_fraction is not None:
        thresholds = lipdp.bounds.bound_fraction_thresholds(model, args.bound_fraction, loss)
        model.dp_parameters = lipdp.DPParameters(
            noise_multiplier=args.noise, delta=1e-5, mode="clipped", clipping="per-layer",
            l2_norm_clip=thresholds, engine="mixed-ghost")
        algorithm = (f"classic DP-SGD clipped per layer at {args.bound_fraction:g} x the "
                     "analytic bounds")
    model.compile(loss=loss, optimizer=tf.keras.optimizers.Adam(args.lr), metrics=["accuracy"],
                  private_logs_only=True)
    model.summary()
    epochs = min(args.epochs, lipdp.get_max_epochs(args.epsilon, model))
    print(f"\n{name}: {epochs} epochs of {algorithm}, sigma={args.noise}, "
          f"q={metadata.sampling_rate:.4f}, budget epsilon={args.epsilon}")
    start = time.time()
    model.fit(ds_train, epochs=epochs, validation_data=ds_test, verbose=2,
              callbacks=[lipdp.DP_Accountant(epsilon_budget=args.epsilon)])
    elapsed = time.time() - start
    epsilon, delta = lipdp.accounting.epsilon_spent(model), dp_parameters.delta
    accuracy = model.evaluate(ds_test, verbose=0)[1]
    radii = [0.0, 0.1, 0.25, 0.5]
    certified = lipdp.certify.certified_accuracy(model, ds_test, radii)
    shown = lipdp.accounting.format_epsilon(epsilon)
    print(f"\n{name} | (epsilon, delta) = ({shown}, {delta:g}) | "
          f"test accuracy {accuracy:.4f} | {model.dp_steps_taken} steps in {elapsed:.0f} s")
    print("certified accuracy: " + ", ".join(f"r={r}: {a:.4f}" for r, a in certified.items()))
    report = lipdp.bounds.tightness(model, ds_test, max_batches=1)
    print("\nbound tightness (observed per-example gradient norm / bound, one test batch; "
          "on training data it would not be private):")
    for variable, row in report.items():
        print(f"  {variable:60s} max {row['max_ratio']:.3f}  mean {row['mean_ratio']:.3f}")
