"""Low-memory conversion: convert a checkpoint tensor by tensor, never holding the model.

The steps, each in its own module:

1. **Plan without the model** (:mod:`~normswap.checkpoint.proxy`): analyse 3- and 4-layer copies
   with random weights, extrapolate the plan to full depth, check it against the meta model.
2. **Rewrite the tensors** (:mod:`~normswap.checkpoint.rewrite`, :mod:`~normswap.checkpoint.stream_io`):
   every output tensor from the input shards, in float64 with the in-memory surgery's arithmetic,
   cast once (bitwise equal to the in-memory path), written by a streaming safetensors writer.
3. **Verify on real weights, at reduced depth** (:mod:`~normswap.checkpoint.truncated`): layers
   0, 1 and L-1 of the converted checkpoint against the same layers of the original.

This module is the entry point: the checks on the source, the disk-space pre-check, the atomic
output directory and the config/manifest, written as the in-memory path writes them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap import pipeline
from normswap.analysis.plan import Plan
from normswap.checkpoint import bases_io, hf, io, proxy, source, stream_io, truncated, writer
from normswap.checkpoint import extrapolate as ex
from normswap.checkpoint.rewrite import KeyMap, TensorRewriter
from normswap.checkpoint.source import NothingToConvert, Source
from normswap.errors import NormswapError, OptionRefused
from normswap.options import ConvertOptions
from normswap.surgery import beta_placement
from normswap.surgery.edits import adapter_bases, mark_untied, record_rms_slots


def convert_streaming(
    src: Source,
    out: Path,
    *,
    fmt: str,
    options: ConvertOptions,
    dtype: str,
    max_shard_size: int | str,
    overwrite: bool,
    task: str | None,
    progress: bool,
    echo: Callable[[str], None],
    automatic: bool = False,
    allow_new_head: bool = False,
    trust_remote_code: bool = False,
) -> pipeline.Report:
    """Convert the checkpoint directory ``src`` into ``out`` without loading the model.

    ``automatic``: the caller chose this path because the in-memory one would not fit (the user did
    not ask for ``--low-memory``); errors then name ``--in-memory`` as the way out. ``allow_new_head``: with
    ``task``, a head the checkpoint lacks is initialised as the in-memory path initialises it
    (:func:`source.init_new_head`) and streamed like the checkpoint's own tensors."""
    st, options = _plan(src, fmt=fmt, options=options, dtype=dtype, task=task, echo=echo, automatic=automatic,
                        allow_new_head=allow_new_head, trust_remote_code=trust_remote_code)
    try:
        return _convert_planned(st, src, out, fmt=fmt, options=options, max_shard_size=max_shard_size,
                                overwrite=overwrite, progress=progress, echo=echo)
    finally:
        st.close()


def _convert_planned(st: _Streaming, src: Source, out: Path, *, fmt: str, options: ConvertOptions,
                     max_shard_size: int | str, overwrite: bool, progress: bool,
                     echo: Callable[[str], None]) -> pipeline.Report:
    needed = _space_needed(st, out, echo)
    # chosen (and a float64 that does not fit refused) before anything is written
    precision = (truncated.truncated_precision(st.cls, st.fp, st.float_dtype, options.verify_dtype)
                 if options.verify else None)
    echo(f"streaming {len(st.entries)} tensors from {len(src.safetensors)} shard(s) ({io.human(src.nbytes)})")
    report = pipeline.Report(st.plan.sites, {}, st.plan, "", changed=True)
    with io.atomic_directory(out, overwrite=overwrite, needed=needed) as tmp:
        out_entries, out_model_keys = _write_tensors(st, tmp, options, fmt, max_shard_size, progress)
        if precision is not None:
            echo(f"verifying layers 0, 1 and L-1 of every stack on the real weights, in {precision.name}"
                 + (f" ({precision.reason})" if precision.reason else ""))
            report.verification.update(truncated.verify_truncated(
                st.cls, st.fp, st.meta, st.entries, out_entries, st.keys, out_model_keys, st.float_dtype,
                st.config.model_type, fmt, precision))
        _write_config(st.meta, st.config, tmp, st.plan, fmt=fmt, out_dtype=st.float_dtype, source_spec=src.spec,
                      verification=report.verification, extra=source.record(src))
        io.copy_side_files(src.path, tmp)
    report.message = st.plan.conversion_line()
    report.output, report.output_format, report.streamed = str(out), fmt, True
    return report


def plan_streaming(src: Source, *, fmt: str, options: ConvertOptions, task: str | None,
                   echo: Callable[[str], None], automatic: bool = False, allow_new_head: bool = False,
                   trust_remote_code: bool = False) -> Plan:
    """The plan :func:`convert_streaming` converts ``src`` with, without writing anything or loading the
    model (``normswap inspect --low-memory``): the proxies' plan extrapolated to full depth, β placed on the
    checkpoint's own tensors, refused where the streamed conversion refuses (approximate norms, nothing to
    convert, tensors that do not match). The adapter bases are not in it: the rewrite records them as it
    edits the tensors."""
    st, options = _plan(src, fmt=fmt, options=options, dtype="auto", task=task, echo=echo, automatic=automatic,
                        allow_new_head=allow_new_head, trust_remote_code=trust_remote_code)
    reader = stream_io.Reader(st.entries)
    try:
        place_beta(st.fp, st.meta, st.keys, reader, options)
        # the mean carries' scales from the checkpoint's own MLP weights, as the rewrite sets them (round 57:
        # inspect showed the random-weight proxies' scales)
        TensorRewriter(st.plan, st.meta, st.keys, reader, fmt=fmt, dtype=None).scale_mean_carries()
    finally:
        reader.close()
        st.close()
    return st.plan


def _plan(src: Source, *, fmt: str, options: ConvertOptions, dtype: str, task: str | None,
          echo: Callable[[str], None], automatic: bool, allow_new_head: bool = False,
          trust_remote_code: bool = False) -> tuple[_Streaming, ConvertOptions]:
    """Open the checkpoint, plan from the proxies, and refuse what the streamed path cannot convert; the
    options as the streamed path applies them."""
    st = _open(src, task, dtype, echo, allow_new_head, trust_remote_code)
    try:
        return _plan_opened(st, src, fmt=fmt, options=options, task=task, echo=echo, automatic=automatic)
    except BaseException:
        st.close()
        raise


def _plan_opened(st: _Streaming, src: Source, *, fmt: str, options: ConvertOptions, task: str | None,
                 echo: Callable[[str], None], automatic: bool) -> tuple[_Streaming, ConvertOptions]:
    if fmt == "native" and st.cls.__module__.startswith("transformers_modules"):  # the in-memory refusal
        raise OptionRefused(f"{src.spec} uses custom modeling code; the native format needs a transformers "
                            "architecture. Use --format compat")
    # bias slots (a bias the checkpoint lacks, for β a bias-less reader takes) are written by the rewrite as the
    # in-memory surgery adds them (round 57; before, the streamed path made none: other tensors than in memory)
    st.fp = proxy.plan_full(st.cls, st.config, st.meta, options, echo=echo, left_out=src.left_out)
    _refuse_plan(st, fmt, automatic)
    _refuse_residual_fold(st, options, automatic)
    _check_tensors(st, task)
    return st, options


@dataclasses.dataclass
class _Streaming:
    """What travels between :func:`convert_streaming`'s steps."""

    src: Source
    config: Any  # the checkpoint's transformers config
    cls: type  # the model class it converts as
    meta: nn.Module  # that model on the meta device: names and shapes, no weights
    entries: dict[str, Any]  # the checkpoint's tensors (:func:`stream_io.scan`), by name
    keys: KeyMap  # checkpoint names <-> model names
    out_dtype: torch.dtype | None  # --dtype (None: each tensor keeps its stored dtype)
    missing: list[str]  # model parameters the checkpoint has no tensor for (after the left-out parts)
    fp: proxy.FullPlan | None = None  # the plan, from random-weight proxies, extrapolated to full depth
    scratch: tempfile.TemporaryDirectory | None = None  # the new head's tensors (--new-head), as a small file

    def close(self) -> None:
        """Remove the new head's file, if any."""
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None

    @property
    def plan(self) -> Plan:
        return self.fp.plan

    @property
    def stored_dtype(self) -> str:
        """The safetensors dtype of the checkpoint's first *floating* tensor (an integer buffer stored first,
        such as the ``position_ids`` older BERT checkpoints keep, says nothing about the weights' dtype), the
        first tensor's where none is floating."""
        dtypes = [e.dtype for e in self.entries.values()]
        return next((d for d in dtypes if stream_io.ST_TO_TORCH.get(d, torch.int64).is_floating_point),
                    dtypes[0])

    @property
    def float_dtype(self) -> torch.dtype:
        """The written checkpoint's floating dtype."""
        return self.out_dtype or stream_io.ST_TO_TORCH.get(self.stored_dtype, torch.float32)


def _open(src: Source, task: str | None, dtype: str, echo: Callable[[str], None],
          allow_new_head: bool = False, trust_remote_code: bool = False) -> _Streaming:
    """The checkpoint's config, model class, meta model and tensor index; the parts the pipeline does not
    use and the checkpoint lacks are left out, as the in-memory path leaves them out; with ``allow_new_head``
    and ``task``, a head the checkpoint lacks is made (:func:`_new_head`)."""
    from transformers import AutoConfig

    assert src.path is not None
    if not src.safetensors:
        raise NormswapError(
            "low-memory conversion reads safetensors only; convert the pickle checkpoint to safetensors first"
        )
    try:
        config = AutoConfig.from_pretrained(src.path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise NormswapError(f"cannot read the config of {src.spec}: {exc}") from exc
    # custom modeling code (round 59): its own class, imported from the directory as the in-memory load does
    cls = (source.remote_code_class(src, task) if trust_remote_code else None) or source.source_class(src, config,
                                                                                                     task)
    with torch.device("meta"):
        meta = cls(copy.deepcopy(config))
    want = source.torch_dtype(dtype)
    entries = stream_io.scan(src.safetensors)
    keys = KeyMap(meta, entries)
    tied_ok = set(getattr(meta, "get_expanded_tied_weights_keys", lambda **_: {})(all_submodels=True))
    missing = [k for k, _ in meta.named_parameters() if k not in keys.to_ckpt and k not in tied_ok]
    if missing and src.layout in source.PIPELINE_READS:
        # as the in-memory path does (source.leave_out_unused), on a small random-weight copy
        src.left_out, missing = leave_out_unused(cls, config, missing, source.PIPELINE_READS[src.layout])
        if src.left_out:
            hf.drop_modules(meta, src.left_out)
            echo(
                f"left out {source.names(src.left_out)}: the checkpoint has no tensors for it, and the "
                f"{src.layout} pipeline does not use it (it reads {source.PIPELINE_READS[src.layout]})"
            )
    st = _Streaming(src, config, cls, meta, entries, keys, None if want == "auto" else want, missing)
    if missing and allow_new_head and task is not None:
        _new_head(st, echo)
    return st


def _new_head(st: _Streaming, echo: Callable[[str], None]) -> None:
    """``--new-head`` streamed (round 59): when every tensor the checkpoint lacks belongs to a part its own
    class does not have (the in-memory rule, :func:`source.check_loading_info`), initialise those tensors as the
    in-memory path does (:func:`source.init_new_head`: same seed, same init, in the dtype the in-memory path
    loads in), save them to a small scratch file and stream them as if the checkpoint held them: the plan's folds
    into the head, the shards and the verification treat them as the checkpoint's own tensors, and the two paths
    write the same head. A head is small (a classifier, a pooler), so this holds no model."""
    from safetensors.torch import save_file

    saved_class = source.checkpoint_class(st.src, st.config)
    if saved_class is None or saved_class is st.cls:
        return
    head = source.new_parts(st.meta, saved_class, st.config, set(st.missing))
    if not head or head != set(st.missing):
        return
    # every name of those tensors, aliases too (BERT's decoder.bias is cls.predictions.bias), as the in-memory
    # load lists them; the scratch file holds each tensor once, under the name the checkpoint check uses
    held = {id(p) for n, p in st.meta.named_parameters(remove_duplicate=False) if n in head}
    names = sorted(head | {n for n, p in st.meta.named_parameters(remove_duplicate=False) if id(p) in held})
    # the in-memory path loads in the checkpoint's dtype (dtype "auto") or in float32 (--dtype given)
    dtype = torch.float32 if st.out_dtype is not None else st.float_dtype
    values = source.init_new_head(st.meta, names, dtype)
    st.scratch = tempfile.TemporaryDirectory(prefix="normswap-new-head-")
    path = Path(st.scratch.name) / "new_head.safetensors"
    save_file({k: values[k].contiguous() for k in sorted(head)}, str(path), metadata={"format": "pt"})
    st.entries = {**st.entries, **stream_io.scan([path])}
    st.keys = KeyMap(st.meta, st.entries)
    st.missing = []
    st.src.new_head = names
    echo(f"new task head, randomly initialised (--new-head): {source.names(names)}; train it before use")


def _refuse_plan(st: _Streaming, fmt: str, automatic: bool) -> None:
    """Refuse a plan with nothing to convert, or with approximate norms: the in-memory path fits those on
    calibration activations of the real model; the streamed path only sees random-weight proxies, so it
    could only copy γ/β, which is what wrecks deep Post-LN models. Refuse instead of writing a worse model."""
    plan, label = st.plan, st.src.label
    if not plan.sites:
        raise NothingToConvert(f"{label}: no LayerNorm found; nothing to do")
    if not any(sp.convert for sp in plan.sites):
        raise NothingToConvert(f"{label}: no LayerNorm can be converted in this mode; nothing to do")
    if fmt == "compat" and any(sp.convert and sp.verdict == "approximate" for sp in plan.sites):
        raise OptionRefused("compat format keeps LayerNorms; convert with --mode exact")
    approximate = sum(1 for sp in plan.sites if sp.convert and sp.verdict == "approximate")
    if approximate and automatic:
        raise OptionRefused(
            f"{label}: {approximate} approximate norm(s) need calibration on the whole model, and "
            "this checkpoint was streamed because its in-memory conversion is predicted not to fit in "
            "the available RAM; pass --in-memory to convert it in memory anyway (with RAM to spare), "
            "or --mode exact to stream only the exact norms"
        )
    if approximate:
        raise OptionRefused(
            f"{label}: {approximate} approximate norm(s) need calibration on the whole model, which "
            "--low-memory cannot do; convert without --low-memory, or add --mode exact to stream only "
            "the exact norms"
        )


def _refuse_residual_fold(st: _Streaming, options: ConvertOptions, automatic: bool) -> None:
    """Refuse ``beta_placement="fold"`` where it would fold a Post-LN norm's β through the residual's writer
    (:class:`~normswap.analysis.plan.ResidualFold`): the streamed rewrite does not, so it would write other
    tensors than the in-memory path for the same options."""
    if options.beta_placement_for(None) != "fold":
        return
    proxy_plan = st.fp.proxy_plan
    folds = [rf for rf in proxy_plan.residual_folds if proxy_plan.site(rf.site).convert]
    if folds:
        way_out = "pass --in-memory" if automatic else "convert without --low-memory"
        raise OptionRefused(
            f"{st.src.label}: beta_placement='fold' folds the β of {len(folds)} Post-LN norm(s) of the proxy "
            f"(`{folds[0].site}`, ...) through their residual writers, which the low-memory path cannot do; "
            f"{way_out} (with RAM to spare), or use another --beta-placement")


def _check_tensors(st: _Streaming, task: str | None) -> None:
    """The same rule as the in-memory load (source.check_loading_info): shapes must match the config, and
    tensors the model does not use are an error unless --task chose a class without the checkpoint's
    head; a tensor the model needs and the checkpoint lacks is an error (a new head cannot be streamed)."""
    src, cls, missing = st.src, st.cls, st.missing
    ignore = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unexpected = [k for k in st.entries if k not in st.keys.to_model and k not in st.keys.buffers
                  and not any(p.search(k) for p in ignore)]
    meta_sd = st.meta.state_dict()
    mismatched = [k for k, m in st.keys.to_model.items() if tuple(st.entries[k].shape) != tuple(meta_sd[m].shape)]
    if mismatched:
        raise NormswapError(
            f"{src.spec}: tensor shape(s) do not match the config for {source.names(mismatched)}; "
            "the checkpoint does not match its config.json"
        )
    if unexpected and task is None:
        raise OptionRefused(
            f"{src.spec}: the checkpoint has tensor(s) {cls.__name__} does not use: "
            f"{source.names(unexpected)}; pass --task to choose the model class on purpose"
        )
    saved_class = source.checkpoint_class(src, st.config) if missing and task is not None else None
    if saved_class is not None and saved_class is not cls:
        head = source.new_parts(st.meta, saved_class, st.config, set(missing))
        if head and head == set(missing):  # as the in-memory path words it
            raise OptionRefused(
                f"{src.spec} as {cls.__name__}: the checkpoint ({saved_class.__name__}) has no "
                f"{source.names(head)}, which {cls.__name__} adds; pass --new-head with --task to "
                "initialise them at random (as transformers does), then train them"
            )
    if missing:
        needed = (
            f", which the {src.layout} pipeline needs (they feed its {source.PIPELINE_READS[src.layout]})"
            if src.layout in source.PIPELINE_READS
            else ""
        )
        raise NormswapError(
            f"{src.spec} as {cls.__name__}: the checkpoint has no tensor(s) {source.names(missing)}{needed}; "
            "the download is incomplete or the files do not belong together"
        )


def _space_needed(st: _Streaming, out: Path, echo: Callable[[str], None]) -> int:
    """Bytes the output needs, checked against the free space before anything is written: untied heads
    are written twice, so they count (and are announced)."""
    src, plan, out_dtype = st.src, st.plan, st.out_dtype
    itemsize = out_dtype.itemsize if out_dtype is not None else stream_io.itemsize(st.stored_dtype)
    untied = sum(u.numel for u in plan.unties) * itemsize
    needed = io.check_space(out, int(src.nbytes * (2 if out_dtype == torch.float32 else 1) * 1.1) + untied
                            + io.side_file_bytes(src.path))
    if plan.unties:
        grown = sum(u.numel for u in plan.unties)
        echo(io.untie_note(len(plan.unties), grown, untied, src.nbytes + untied))
    return needed


def _write_tensors(st: _Streaming, tmp: Path, options: ConvertOptions, fmt: str, max_shard_size: int | str,
                   progress: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Place β on the checkpoint's own tensors, then rewrite every tensor into shards in ``tmp``; the
    written tensors' index and their model names, for the verification."""
    reader = stream_io.Reader(st.entries)
    try:
        place_beta(st.fp, st.meta, st.keys, reader, options)
        rewriter = TensorRewriter(st.plan, st.meta, st.keys, reader, fmt=fmt, dtype=st.out_dtype)
        rewriter.scale_mean_carries()  # before the layout: the widened MLPs take the real weights' scale
        # the adapter bases from the checkpoint's own tensors, as the in-memory surgery records them
        adapter_bases(st.meta, st.plan, lambda site: rewriter.norms.get(site, (None, None)),
                      lambda name: rewriter.read(name).double(), lambda sf: rewriter.edited(sf.param).reshape(-1))
        bases_io.write(st.plan, tmp)
        layout = in_memory_order(st.meta, rewriter.layout())
        buffers = {name for name, _ in st.meta.named_buffers(remove_duplicate=False)}
        parameters = sum(math.prod(entry[2]) for entry in layout if entry[4] not in buffers)
        weight_map = stream_io.write_shards([entry[:4] for entry in layout], tmp, io.parse_size(max_shard_size),
                                            progress, parameters=parameters)
    finally:
        reader.close()
    out_model_keys = {entry[4]: entry[0] for entry in layout if entry[4] is not None}
    return stream_io.scan(sorted({tmp / f for f in weight_map.values()})), out_model_keys


def in_memory_order(meta: nn.Module, layout: list) -> list:
    """``layout`` (entries whose last field is the model's name for the tensor) in the order the in-memory
    conversion's ``save_pretrained`` meets the same tensors, so that it splits the streamed checkpoint into the
    same files (round 59; before, the checkpoint's own order). That order is the converted model's state-dict
    order (the meta model's: the surgery swaps modules in place and fills a bias slot where the module
    registered ``None``; a tensor the model lacks goes after its module's own tensors), then, in transformers 5,
    sorted by name (``revert_weight_conversion`` sorts a loaded model's state dict with ``dot_natural_key``)."""
    rank: dict[str, tuple[int, int]] = {}
    for path, module in meta.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        own = [*module._parameters, *(b for b in module._buffers if b not in module._non_persistent_buffers_set)]
        for name in own:
            rank.setdefault(prefix + name, (len(rank), 0))
        if own:
            rank.setdefault(f"{prefix}\0", (len(rank) - 1, 1))  # after this module's own tensors

    def where(item: tuple[int, Any]) -> tuple[int, int, int]:
        i, entry = item
        name = entry[4] or ""
        found = rank.get(name) or rank.get(f"{name.rpartition('.')[0]}.\0" if "." in name else "\0")
        return (*(found or (len(rank), 0)), i)

    ordered = [entry for _, entry in sorted(enumerate(layout), key=where)]
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:  # transformers 4: save_pretrained keeps the state-dict order
        return ordered
    return sorted(ordered, key=lambda entry: dot_natural_key(entry[4] or entry[0]))


def place_beta(fp: proxy.FullPlan, meta: nn.Module, keys: KeyMap, reader: stream_io.Reader,
               options: ConvertOptions) -> None:
    """The β placement rule (:mod:`normswap.surgery.beta_placement`) on the checkpoint's own tensors.

    The plan came from random-weight proxies, so the rule (a function of the weights) is applied here,
    after the extrapolation, reading each reader's weight and bias and each norm's β from the shards:
    the same values the in-memory path reads, hence the same decisions. The truncated verification
    model is built from the proxy plan, whose layer ``t`` stands for full layer ``representative(t)``:
    it takes that layer's decision."""
    expand = getattr(meta, "get_expanded_tied_weights_keys", None)
    ties = expand(all_submodels=True) if callable(expand) else {}

    def tensor(name: str) -> torch.Tensor:
        key = keys.to_ckpt.get(name) or keys.to_ckpt.get(ties.get(name, name))
        if key is None:
            raise NormswapError(f"the checkpoint has no tensor for {name}; it does not match its config")
        return reader.get(key).double()

    def beta_of(norm: str) -> torch.Tensor | None:
        _, b_attr = writer.norm_param_names(meta.get_submodule(norm), fp.plan.site(norm).flavour)
        return tensor(f"{norm}.{b_attr}") if b_attr else None

    keep = beta_placement.head_readers(fp.plan, meta)
    kept = {name: fp.plan.site(name).beta_detail
            for name in beta_placement.place_beta(fp.plan, tensor, beta_of, options.beta_placement_for(None), keep)}
    for sp in fp.proxy_plan.sites:
        full = fp.full_name(sp.name)
        if full in kept and beta_placement.applies(fp.proxy_plan, sp):
            beta_placement.keep_beta(fp.proxy_plan, sp, kept[full])
    fp.proxy_plan.options["beta_placement"] = fp.plan.options["beta_placement"]
    record_rms_slots(fp.plan)
    record_rms_slots(fp.proxy_plan)


def leave_out_unused(cls: type, config: Any, missing: list[str], reads: str) -> tuple[list[str], list[str]]:
    """:func:`source.leave_out_unused` without the model: the test (does a NaN in the missing module
    reach the pipeline's output?) runs on a 3-layer copy with random weights, which has the same
    modules outside the layer stacks. A missing tensor inside a layer stack (whose copy has other
    depths) is not tested and stays missing, an error, as a needed one would."""
    small = proxy.build_proxy(cls, proxy.reduced_config(config, ex.PROXY_DEPTH), torch.float32)
    names = {k for k, _ in small.named_parameters()}
    stacks = tuple(p + "." for p in proxy.stacks_of(small))
    testable = [k for k in missing if k in names and not k.startswith(stacks)]
    left_out, _ = source.leave_out_unused(small, testable, reads)
    del small
    gone = {k for k in missing if any(k.startswith(p + ".") for p in left_out)}
    return left_out, [k for k in missing if k not in gone]


def _write_config(
    meta: nn.Module,
    config: Any,
    out: Path,
    plan: Plan,
    *,
    fmt: str,
    out_dtype: torch.dtype,
    source_spec: str,
    verification: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """config.json (+ generation config, modeling file, model card) as the in-memory path writes them."""
    cfg = copy.deepcopy(config)
    holder = meta
    holder.config = cfg
    if plan.unties:
        mark_untied(holder)
    cfg.architectures = [type(meta).__name__]
    cfg.dtype = out_dtype
    cfg.save_pretrained(out)
    gen = getattr(meta, "generation_config", None)
    if gen is not None and callable(getattr(meta, "can_generate", None)) and meta.can_generate():
        gen.save_pretrained(out)
    manifest = writer.build_manifest(
        meta, plan, fmt=fmt, verification=verification, source=source_spec, extra=extra
    )
    if fmt == "native":
        writer.make_native_config(meta, out, manifest)
    else:
        manifest.update(writer.compat_lists(plan))
        writer.add_manifest(out, manifest)
    (out / "README.md").write_text(writer.model_card(manifest, out.name.split(io.TMP_MARK)[0].lstrip(".")))
