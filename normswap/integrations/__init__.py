"""Where a converted model goes after conversion: exporters, trainers, savers.

Submodules (each imported on its own, so ``import normswap`` stays light):

* :mod:`normswap.integrations.onnx`: ``fused_norm_ops``, which counts the norm ops ONNX Runtime's
  optimiser leaves in an exported file (one fused op per converted norm), ``fuse_norms``, which puts each
  converted norm's residual and bias ``Add``s into ``SkipSimplifiedLayerNormalization``, and ONNX translations for the
  fused custom ops (only needed when a fused backend was asked for explicitly; what ``normswap.RMSNorm``
  computes under ``torch.export``, ``torch.onnx.export`` and ``torch.jit.trace`` is the backends'
  portable path, :mod:`normswap.backends.portable`).
* :mod:`normswap.integrations.executorch`: ``delegable_norms``, which makes ``torch.export`` record each
  ``normswap.RMSNorm`` in a form ExecuTorch's XNNPACK backend delegates whole (the mean of squares as a
  fully-connected op); opt-in, because the default form is the one ONNX Runtime fuses.
* :mod:`normswap.integrations.trainer`: transformers' weight-decay rules see ``normswap.RMSNorm`` as a
  norm (set up by ``normswap.patch`` and ``normswap.load``; call ``register()`` for RMSNorms you build
  yourself).
* :mod:`normswap.integrations.saving`: ``save_pretrained`` on a model patched in memory writes a native
  normswap checkpoint (set up by ``normswap.patch`` on the model it converts).
* :mod:`normswap.integrations.wrappers`: the model inside a sentence-transformers object or a
  ``torch.compile``'d module, which ``normswap.plan`` / ``normswap.patch`` convert in place (a leaf module).
* :mod:`normswap.integrations.quiet`: other libraries' progress bars and warnings off while normswap
  loads, converts and saves (their own switches, restored afterwards; a leaf module).
"""
