"""Choosing, in tests, how lipdp certifies a convolution (`lipdp.gram_certificates`)."""

from lipdp import gram_certificates

#: The two ways `conv_norm_upper` computes a convolution's frequency Gram matrices.
CONV_GRAM_WAYS = ("_grams_by_tap_pairs", "_grams_by_transform")


def force_conv_gram_way(monkeypatch, way):
    """Make every `conv_norm_upper` compute its Gram matrices by `way` (one of
    `CONV_GRAM_WAYS`), whatever its cost model picks; returns the list to which each such
    computation appends `way` (to check that the forced way ran)."""
    chosen, used = getattr(gram_certificates, way), []
    for name in CONV_GRAM_WAYS:
        monkeypatch.setattr(gram_certificates, name,
                            lambda *args: used.append(way) or chosen(*args))
    return used
