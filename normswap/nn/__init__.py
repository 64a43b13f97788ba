"""``normswap.RMSNorm`` and its functional form ``normswap.rms_norm``, above the backends."""
