"""Test-session set-up: TensorFlow's oneDNN CPU kernels are switched off.

TensorFlow 2.15's oneDNN kernels (on by default on x86 CPUs, in both the
``tensorflow`` and ``tensorflow-cpu`` wheels) have two bugs the tests reach:

* ``Conv2DBackpropFilter`` of a 1x1 kernel with strides (2, 1) and 'same'
  padding fails with "could not create a primitive descriptor for a reorder
  primitive" or corrupts the heap and aborts the process (reproduced with a
  plain ``GradientTape`` on ``Conv2D(2, 1, strides=(2, 1), padding="same")`` and
  a (1, 6, 7, 3) input, no lipdp code involved);
* a convolution of an empty batch returns a tensor of its *input's* shape.

Both are TensorFlow's (the README lists them under "Sharp edges"); the Eigen
kernels used without oneDNN are correct. The variable must be set before
TensorFlow is first imported, which is why it lives here.
"""

import os

os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
