"""The HSTU generative recommender: ``HSTUModel`` with ``prefill``, ``rank``, ``rank_full`` and ``forward``.

Import from here; the modules are:

* ``module``: the ``nn.Module``, its parameters and the four operations side by side;
* ``ops``: the attention kernels and the switch that picks one by device;
* ``checkpoint``: the weights file format (``read_weights``, what ``save`` and ``load`` use);
* ``options``: ``ModelConfig``, its dimensions and semantics options, validated when made;
* ``values``: ``History`` and ``PrefixKV``, what the operations take and return;
* ``checks``: the serving entry points' input checks (``ModelInputError`` by field).

An edit's tensors (``EditTensors``, ``LowRankMap``) live beside the editing code, in
``relay_engine.core.edit_tensors``, and are re-exported here because every operation takes one.
"""

from relay_engine.core.edit_tensors import EditTensors, LowRankMap
from relay_engine.core.model.checkpoint import (
    WEIGHTS_FORMAT,
    WEIGHTS_FORMAT_VERSION,
    WeightsFileError,
    read_weights,
)
from relay_engine.core.model.module import HSTULayer, HSTUModel
from relay_engine.core.model.options import MODEL_OPTIONS, ModelConfig
from relay_engine.core.model.values import History, ModelInputError, PrefixKV

__all__ = [
    "MODEL_OPTIONS",
    "WEIGHTS_FORMAT",
    "WEIGHTS_FORMAT_VERSION",
    "EditTensors",
    "HSTULayer",
    "HSTUModel",
    "History",
    "LowRankMap",
    "ModelConfig",
    "ModelInputError",
    "PrefixKV",
    "WeightsFileError",
    "read_weights",
]
