"""Private Lipschitz MLP on Fashion-MNIST (lipdp.zoo.mlp).

    .venv/bin/python examples/mlp.py [--epochs 43] [--epsilon 3]
"""

import lipdp
from _common import parse_args, run

if __name__ == "__main__":
    args = parse_args(__doc__, epochs=43)
    run(args, lambda params, metadata: lipdp.zoo.mlp(
        metadata.input_shape, metadata.nb_classes, width=1024, depth=1,
        dp_parameters=params, dataset_metadata=metadata), "MLP")
