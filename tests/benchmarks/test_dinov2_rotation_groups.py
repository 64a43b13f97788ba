"""Pieces of ``benchmarks/dinov2_rotation_groups.py`` (the group-at-a-time 4-bit attribution on DINOv2).

What could be silently wrong: a ``keep-K`` matrix that is not orthogonal or not mean-preserving (the rotated
model would no longer be exact, and every ratio it gave would measure a different model), that turns the
channels it says it keeps or keeps the wrong ones; a group that holds other Linears than it names; and a
group measurement that leaves its rounding in the model, so every later group is measured on a rounded one.
"""

from __future__ import annotations

import copy
import warnings

import torch

from tests import benchmark_modules

groups = benchmark_modules.load("dinov2_rotation_groups")


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _patched() -> tuple[torch.nn.Module, torch.nn.Module]:
    import normswap

    model = benchmark_modules.tiny_dinov2(3)
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, fold_gamma=True)
    return model, conv


def test_keep_matrix_is_an_exact_rotation_that_keeps_the_highest_energy_channels() -> None:
    from normswap.nn.rmsnorm import RMSNorm

    _, conv = _patched()
    calib = _pixels(4, 1)
    with torch.no_grad():
        conv.embeddings.cls_token[..., 5] += 30  # a massive channel the ranking must find
    q = groups.keep_matrix(conv, 32, 4, calib)
    eye = torch.eye(32, dtype=torch.float64)
    assert float((q.T @ q - eye).abs().max()) < 1e-12
    assert float((q.sum(1) - 1).abs().max()) < 1e-12  # Q·1 = 1: a centered stream stays centered
    kept = [i for i in range(32) if float((q[i] - eye[i]).abs().max()) == 0 and float((q[:, i] - eye[:, i])
                                                                                    .abs().max()) == 0]
    assert len(kept) == 4 and 5 in kept
    # the kept channels are those of largest energy in the norms' outputs
    energy = torch.zeros(32, dtype=torch.float64)

    def record(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        energy.add_(out.detach().pow(2).reshape(-1, 32).mean(0))

    hooks = [m.register_forward_hook(record) for m in conv.modules() if isinstance(m, RMSNorm)]
    groups.outputs(conv, calib)
    for h in hooks:
        h.remove()
    assert sorted(kept) == sorted(energy.topk(4).indices.tolist())
    rest = [i for i in range(32) if i not in kept]
    assert float(q[rest][:, rest].abs().min()) > 0  # the other channels are all turned into each other


def test_keep_rotation_with_smoothing_is_exact_in_float64() -> None:
    import normswap

    model, conv = _patched()
    px = _pixels(3, 2)
    q = groups.keep_matrix(conv, 32, 4, _pixels(4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.rotate(conv, q, output="restore", smooth=0.5, calibration=[{"pixel_values": _pixels(4, 5)}])
    ref, out = groups.outputs(model, px), groups.outputs(conv, px)
    assert float((ref[0] - out[0]).abs().max()) < 1e-9
    assert float((ref[1] - out[1]).abs().max()) < 1e-9


def test_groups_hold_the_linears_they_name_and_measuring_leaves_the_model_unrounded() -> None:
    model = benchmark_modules.tiny_dinov2(0)
    names = list(groups.linears(model))
    assert len(names) == 12  # 2 layers × q, k, v, o, fc1, fc2
    v1 = "encoder.layer.1.attention.v_proj"
    assert groups.in_group(v1, "readers") and groups.in_group(v1, "L1.readers") and groups.in_group(v1, "v_proj")
    assert not groups.in_group(v1, "writers") and not groups.in_group(v1, "L0.readers")
    fc2 = "encoder.layer.0.mlp.fc2"
    assert groups.in_group(fc2, "L0.writers") and not groups.in_group(fc2, "fc1")
    for g in groups.group_names(2, True):
        assert any(groups.in_group(n, g) for n in names), g
    before = {k: v.clone() for k, v in model.state_dict().items()}
    px = _pixels(2, 4)
    ref = groups.outputs(model, px)
    err = groups.group_errors(model, px, ref, ["all", "L1.writers"])
    assert all(v.equal(model.state_dict()[k]) for k, v in before.items())
    assert min(err["all"]["tok"]) > 0  # the rounding did reach the model while measured


def test_online_variants_and_their_edits_are_exact_and_do_what_they_say() -> None:
    """``online[-bB][+shift][+smooth-A|+awq-A]``: the edits before the ops keep the function (float64); the shift
    centres each norm's output per channel on the calibration crops; smoothing leaves the norms' γ ÷ s; and the
    grid option rounds as asked."""
    from normswap.rotation.learn import fake_quant

    model = benchmark_modules.tiny_dinov2(3)
    calib, px = _pixels(4, 1), _pixels(3, 2)
    ref = groups.outputs(model, px)
    for name in ("online", "online-b8@1", "online+shift", "online+smooth-0.5", "online+awq-0.5",
                 "online+shift+smooth-0.5"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = groups.build(model, name, calib)
        out = groups.outputs(m, px)
        assert float((ref[1] - out[1]).abs().max() / ref[1].abs().max()) < 1e-9, name
    # the shift: every norm's output (before the op) averages to zero per channel on the calibration crops
    import normswap

    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, beta_placement="keep")
    groups.migrate_(conv, "shift", calib)
    seen = []
    h = conv.encoder.layer[1].norm2.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    groups.outputs(conv, calib)
    h.remove()
    assert float(torch.cat(seen).reshape(-1, 32).mean(0).abs().max()) < 1e-9
    # the grid option
    w = torch.randn(4, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    groups.GRID.update(grid="asymmetric", group_size=128)
    try:
        assert torch.equal(groups.rtn4(w), fake_quant(w, 4, 1, 128, "asymmetric"))
    finally:
        groups.GRID.update(grid="full", group_size=32)
    assert torch.equal(groups.rtn4(w), fake_quant(w, 4, 1, 32, "full"))


def test_block_grids_reports_each_kind_and_the_grids_differ() -> None:
    model = benchmark_modules.tiny_dinov2(0)
    found = groups.block_grids(model, 32)
    assert sorted(found) == sorted(groups.READERS + groups.WRITERS)
    for ea, es, share in found.values():
        assert 0 < ea < 1 and 0 < es < 1 and ea != es and 0 <= share < 1


def test_learned_online_scales_are_exact_and_replay_before_the_ops(tmp_path) -> None:
    """``dinov2_online_scales.py``'s edit: scales ``t`` put between each norm and its readers with the op in place
    (``W Mᵀ diag(t) M``) keep the function in float64, and ``migrate_``'s ``scales=PATH`` (the same ``t`` before
    the ops, what ``bench_quant_engines.py`` replays) builds the very same weights."""
    scales = benchmark_modules.load("dinov2_online_scales")
    model = benchmark_modules.tiny_dinov2(3)
    calib, px = _pixels(4, 1), _pixels(3, 2)
    conv = groups.build(model, "online+smooth-0.5", calib)
    pairs = groups.norm_readers(conv)
    gen = torch.Generator().manual_seed(7)
    ts = {n: torch.exp(torch.randn(32, generator=gen, dtype=torch.float64)) for n in pairs}
    for n, rd in pairs.items():
        m = scales.op_matrix(conv, n, rd)
        assert float((m @ m.T - torch.eye(32, dtype=torch.float64)).abs().max()) < 1e-12
        scales.apply_after_ops_(conv, n, rd, ts[n], m)
    ref, out = groups.outputs(model, px), groups.outputs(conv, px)
    assert float((ref[1] - out[1]).abs().max() / ref[1].abs().max()) < 1e-10
    torch.save(ts, tmp_path / "t.pt")
    replay = groups.build(model, f"online+smooth-0.5+scales={tmp_path / 't.pt'}", calib)
    state, other = conv.state_dict(), replay.state_dict()
    assert max(float((state[k] - other[k]).abs().max()) for k in state) < 1e-10
    unscaled = groups.build(model, "online+smooth-0.5", calib).state_dict()
    fc1 = "encoder.layer.0.mlp.fc1.weight"
    assert float((state[fc1] - unscaled[fc1]).abs().max()) > 1e-3  # the scales did change the weights
