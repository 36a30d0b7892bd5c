#!/usr/bin/env bash
# Obtain Fashion-MNIST on a Debian machine without internet: the package
# `dataset-fashion-mnist` installs the standard IDX files in /usr/share/datasets/fashion-mnist.
set -euo pipefail
if ls /usr/share/datasets/fashion-mnist/*.gz >/dev/null 2>&1; then
  echo "lipdp: Fashion-MNIST found in /usr/share/datasets/fashion-mnist"; exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "lipdp: Fashion-MNIST is missing and this is not a Debian machine." >&2
  echo "       Put the four IDX .gz files in \$LIPDP_DATA_DIR/fashion_mnist and retry." >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
echo "lipdp: installing Debian package dataset-fashion-mnist (Fashion-MNIST IDX files)..."
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist
echo "lipdp: Fashion-MNIST installed in /usr/share/datasets/fashion-mnist"
