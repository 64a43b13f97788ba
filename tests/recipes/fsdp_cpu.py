"""``python tests/recipes/fsdp_cpu.py RECIPE [key=value ...]``: the recipe under accelerate's FSDP2 path, on CPU.

accelerate offers FSDP only on accelerators (on CPU it picks plain multi-process data parallelism), so
this launcher makes the one choice it would make on a GPU machine, a GPU-style distributed type,
over gloo with the device forced to CPU; everything after that (``fully_shard`` with the shipped
config's wrap policy and mixed precision, the DTensor-aware gradient clipping, sharded checkpoints,
the gathered state dict) is accelerate's and torch's own code. One process by default; under
``torchrun`` it takes RANK/WORLD_SIZE from there. The settings mirror
recipes/accelerate/fsdp.yaml (as ``accelerate launch`` would export them).
"""

from __future__ import annotations

import os
import socket
import sys


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main() -> None:
    if "MASTER_PORT" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    os.environ.update(
        ACCELERATE_TORCH_DEVICE="cpu", ACCELERATE_USE_FSDP="true", FSDP_VERSION="2",
        FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP", FSDP_RESHARD_AFTER_FORWARD="true",
        FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT", FSDP_OFFLOAD_PARAMS="false",
        FSDP_CPU_RAM_EFFICIENT_LOADING="false", FSDP_ACTIVATION_CHECKPOINTING="false",
    )
    os.environ.setdefault("ACCELERATE_MIXED_PRECISION", "no")
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    def backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        return "gloo", DistributedType.MULTI_GPU  # accelerate then switches it to FSDP (ACCELERATE_USE_FSDP)

    PartialState._prepare_backend = backend
    from normswap.cli.finetune_cmd import finetune

    finetune(args=sys.argv[1:], prog_name="fsdp_cpu.py")


if __name__ == "__main__":
    main()
