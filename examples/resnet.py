"""Private Lipschitz ResNet on Fashion-MNIST (lipdp.zoo.resnet).

    .venv/bin/python examples/resnet.py [--epochs 5] [--epsilon 3]

On 2 CPU cores one epoch takes a few minutes; use --train-examples for a quick run.
"""

import lipdp
from _common import parse_args, run

if __name__ == "__main__":
    args = parse_args(__doc__, epochs=5)
    run(args, lambda params, metadata: lipdp.zoo.resnet(
        metadata.input_shape, metadata.nb_classes, width=8, stages=2, blocks_per_stage=1,
        dp_parameters=params, dataset_metadata=metadata), "ResNet")
