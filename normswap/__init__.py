"""normswap: convert LayerNorm to RMSNorm in Hugging Face and custom PyTorch models.

Exact where the math allows (every writer of a norm's input stream centered by fp64 weight
surgery), honest where it doesn't (Post-LN norms are marked approximate, with measured error).
"""

from normswap.api import Report, patch, plan
from normswap.checkpoint import convert, load
from normswap.errors import NormswapError
from normswap.integrations import trainer as _trainer
from normswap.norm import RMSNorm, rms_norm
from normswap.plan import Plan
from normswap.rotate import Rotation, rotate

_trainer.register()  # transformers' Trainer: RMSNorm parameters get no weight decay, like LayerNorm's

__version__ = "0.1.0"

__all__ = ["NormswapError", "Plan", "RMSNorm", "Report", "convert", "load", "patch", "plan", "rms_norm", "rotate",
           "Rotation", "__version__"]
