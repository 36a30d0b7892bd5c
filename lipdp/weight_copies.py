"""The ledger of copied weights: trained values remembered with the ledger that trained them.

A DP model's privacy ledger lives in its own variables and travels with its whole weight
list (`get_weights`, checkpoints, saved models). Weights copied layer by layer
(``new.layers[i].set_weights(old.layers[i].get_weights())``, ``variable.assign``) leave it
behind: the new model reported only its own steps for weights another run had trained.
This module remembers, for the process, the values a DP model's trainable variables hold
after its private steps (`remember`: at the end of every `fit` epoch and `fit` and
`train_on_batch` call, and whenever the model or one of its DP layers hands its weights
out), each with the ledger that produced it (`TrainedBy`). A model looks up the values it
holds (`origins`) and composes those ledgers with its own
(`DP_Model._take_copied_values`).

Found: a variable holding exactly (same dtype, shape and bytes) a value that another DP
model object's private steps produced in this process and that was remembered. Not found:
a value changed after the copy (scaled, sliced, trained on before the model looked it up),
a value read from the variables themselves (``variable.numpy()``, ``assign(variable)``)
between two epochs' ends or two `train_on_batch` calls of a model that trained on since
(`remember`, ``transient``), a copy made in another process (README, pitfalls).

Values are keyed by their dtype, shape and a hash of the bytes of a fixed sample of their
entries (`_key`: at most `SAMPLED_ENTRIES`, spread over the whole value), so that a lookup
costs a fraction of a millisecond for a 784 x 1024 kernel. Two values of one key, whether
they differ elsewhere or their samples' hashes collide, compose a ledger that did not train
the model (an over-report), with one exception: a copied value whose key is also that of a
value the model's own steps produced is taken for its own (`origins`). That needs the two
to agree at every sampled entry and differ elsewhere, which values that private steps
noised everywhere do not do (an audit, 2026-12-06, found it by reading the code).
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Dict, Iterable, List, Optional, Set, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class TrainedBy:
    """The ledger of the model object whose private steps produced a value, as it stood
    then: its token (`DP_Model._ledger_token`), ``state = (steps, rows)`` and ``lineage``,
    ``((token, steps), ...)`` of the other ledgers it included, and ``draws_until``, the
    end of the Poisson draws its history may have used (`DP_Model.poisson_draws_until`)."""

    token: int
    state: Tuple[int, np.ndarray]
    lineage: Tuple[Tuple[int, int], ...]
    draws_until: int = 0


_Key = Tuple[str, Tuple[int, ...], int]

#: A remembered value's key (`_key`) -> token -> the ledger of most steps that produced it.
_TRAINED_BY: Dict[_Key, Dict[int, TrainedBy]] = {}
#: dtype and shape -> how many values of them each token left (a variable of a shape that
#: no other model left is not hashed).
_TOKENS_BY_SHAPE: Dict[Tuple[str, Tuple[int, ...]], collections.Counter] = (
    collections.defaultdict(collections.Counter))
#: The (key, token) pairs kept for the process (not transient).
_KEPT: Set[Tuple[_Key, int]] = set()
#: token -> id of a variable -> the key of the value its last transient call left.
_LATEST: Dict[int, Dict[int, _Key]] = collections.defaultdict(dict)


#: DP models given a ledger from a file whose values are not remembered yet (`note_loaded`).
_LOADED = weakref.WeakSet()

#: The most entries of a value that its key (`_key`) reads.
SAMPLED_ENTRIES = 4096


def _dtype_and_shape(variable):
    """``(dtype, shape)`` of a variable; None for one of a shape not fully known (the
    ledger's own rows), which no model remembers."""
    if not variable.shape.is_fully_defined():
        return None
    return np.dtype(variable.dtype.as_numpy_dtype).str, tuple(variable.shape.as_list())


def _key(variable) -> _Key:
    """A variable's dtype, shape and the hash of its entries' bytes at a fixed stride (every
    entry up to `SAMPLED_ENTRIES`; the stride odd, so that it does not follow a power-of-two
    row length, and the last entry read too). The value is read without `read_value`'s
    identity op, which doubled a small variable's read."""
    array = np.asarray(variable.value().numpy())
    flat = array.reshape(-1)
    stride = max(1, flat.size // SAMPLED_ENTRIES) | 1
    sample = np.concatenate([flat[::stride], flat[-1:]]) if stride > 1 else flat
    return (array.dtype.str, array.shape, hash(np.ascontiguousarray(sample).tobytes()))


def keys_of(variables: Iterable) -> Dict[int, _Key]:
    """``{id(variable): its key}``: the values `variables` hold now (`remember`'s
    ``untrained``)."""
    return {id(variable): _key(variable) for variable in variables}


def remember(variables: Iterable, trained_by: TrainedBy, transient: bool = False,
             untrained: Optional[Dict[int, _Key]] = None) -> None:
    """Remember the values `variables` hold now as produced by the ledger `trained_by`
    (nothing for a ledger of no step), but those still equal to what they held before the
    model's steps began (`untrained`, from `keys_of`: a learning rate of 0 leaves the
    initial values, which no step produced); for a value already remembered for the same
    token, the ledger of more steps is kept.

    `transient` (the end of a `train_on_batch` call): a variable's value replaces the one
    its previous transient call left (unless that one was also remembered otherwise), so a
    loop of many calls does not grow the registry. Other values (epochs' ends, weights
    handed out) are kept for the process."""
    token = trained_by.token
    if not trained_by.state[0]:
        return
    latest = _LATEST[token]
    untrained = untrained or {}
    for variable in variables:
        key = _key(variable)
        if untrained.get(id(variable)) == key:
            continue
        ledgers = _TRAINED_BY.setdefault(key, {})
        kept = ledgers.get(token)
        if kept is None:
            _TOKENS_BY_SHAPE[key[:2]][token] += 1
        if kept is None or kept.state[0] < trained_by.state[0]:
            ledgers[token] = trained_by
        if not transient:
            _KEPT.add((key, token))
            continue
        previous, latest[id(variable)] = latest.get(id(variable)), key
        if previous is not None and previous != key and (previous, token) not in _KEPT \
                and previous not in latest.values():
            _forget(previous, token)


def _forget(key: _Key, token: int) -> None:
    ledgers = _TRAINED_BY[key]
    del ledgers[token]
    if not ledgers:
        del _TRAINED_BY[key]
    counts = _TOKENS_BY_SHAPE[key[:2]]
    counts[token] -= 1
    if not counts[token]:
        del counts[token]


def origins(variables: Iterable, token: int) -> List[TrainedBy]:
    """The ledgers that produced the values `variables` hold, one per token (that of most
    steps), for the values that the steps of the model of `token` did not produce: a value
    it left itself is its own, which its ledger counts, even when another model left it
    too (a seeded program run twice trains two models to the same values; neither copied
    the other). Only variables of a dtype and shape that another token left are hashed."""
    found: Dict[int, TrainedBy] = {}
    for variable in variables:
        shape = _dtype_and_shape(variable)
        tokens = _TOKENS_BY_SHAPE.get(shape) if shape is not None else None
        if not tokens or set(tokens) <= {token}:
            continue
        ledgers = _TRAINED_BY.get(_key(variable), {})
        if token in ledgers:
            continue
        for other, trained_by in ledgers.items():
            if other not in found or found[other].state[0] < trained_by.state[0]:
                found[other] = trained_by
    return list(found.values())


def note_loaded(model) -> None:
    """Note a DP model given a ledger from a file (`load_weights`, Keras' loading of a saved
    model): its values are to be remembered before another model looks its own up
    (`DP_Model._take_copied_values`), once loaded."""
    _LOADED.add(model)


def loaded_models() -> List:
    """The models `note_loaded` noted and that have not remembered their values since."""
    return list(_LOADED)


def forget_loaded(model) -> None:
    """`model`'s values are remembered (or left to another model's ledger)."""
    _LOADED.discard(model)


def clear() -> None:
    """Forget every value remembered, and every loaded model noted. For tests, each of which
    stands for a program of its own: a seeded test suite trains models of different tests to
    the same values, which one process would otherwise take for copies of each other."""
    for registry in (_TRAINED_BY, _TOKENS_BY_SHAPE, _LATEST):
        registry.clear()
    _KEPT.clear()
    _LOADED.clear()
