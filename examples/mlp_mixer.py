"""Private Lipschitz MLP-Mixer on Fashion-MNIST (lipdp.zoo.mlp_mixer).

    .venv/bin/python examples/mlp_mixer.py [--epochs 10] [--epsilon 3]
"""

import lipdp
from _common import parse_args, run

if __name__ == "__main__":
    args = parse_args(__doc__, epochs=10)
    run(args, lambda params, metadata: lipdp.zoo.mlp_mixer(
        metadata.input_shape, metadata.nb_classes, patch_size=4, hidden_dim=64, depth=1,
        dp_parameters=params, dataset_metadata=metadata), "MLP-Mixer")
