"""Private Lipschitz VGG on Fashion-MNIST (lipdp.zoo.vgg).

    .venv/bin/python examples/vgg.py [--epochs 5] [--epsilon 3]

On 2 CPU cores one epoch takes a few minutes; use --train-examples for a quick run.
"""

import lipdp
from _common import parse_args, run

if __name__ == "__main__":
    args = parse_args(__doc__, epochs=5)
    run(args, lambda params, metadata: lipdp.zoo.vgg(
        metadata.input_shape, metadata.nb_classes, widths=(16, 32), convs_per_block=1,
        dense_width=128, dp_parameters=params, dataset_metadata=metadata), "VGG")
