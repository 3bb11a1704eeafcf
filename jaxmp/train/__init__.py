"""The trainer (layer 6): state, optimizer, the one step builder, the loop, resume, metrics.

:class:`Trainer` is the front door (``jaxmp.Trainer``); :mod:`jaxmp.train.step` holds the only
train-step builder, which ``Trainer.compile`` uses for training, ``jaxmp plan --verify`` and
``jaxmp bench`` alike.
"""

from jaxmp.train.loop import Trainer
from jaxmp.train.state import Extension, StateLayout, TrainState

__all__ = ["Extension", "StateLayout", "TrainState", "Trainer"]
