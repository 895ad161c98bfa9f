"""Stateful layers written on eqstate: their parameters, running statistics and hidden
states are state handles, so they are plain `eqx.Module`s that need no state argument."""

from ._batch_norm import BatchNorm as BatchNorm
from ._dropout import Dropout as Dropout
from ._rnn import GRUCell as GRUCell, LSTMCell as LSTMCell, RNNCell as RNNCell
