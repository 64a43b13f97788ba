"""``normswap backends`` and ``normswap bench``: what can run here, and how fast."""

from __future__ import annotations

import json

import click

from normswap.cli import main
from normswap.cli.common import handle_errors
from normswap.errors import NormswapError, UsageError

SPREAD_WARN = 1.5  # max/min of the per-round ratios beyond which a ratio is not to be trusted


@main.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
@handle_errors
def backends_cmd(as_json: bool) -> None:
    """List the RMSNorm backends, whether each can run here and why, and what ``auto`` picks.

    \b
    Example:
      $ normswap backends
      backend  available  reason
      eager    yes        pure PyTorch, always available
      cpu      yes        fused C++ kernel, ISA level 3, OpenMP, ...
      triton   no         no CUDA device (set TRITON_INTERPRET=1 ...)
      auto on cpu float32 2048x4096 -> cpu: fused C++ kernel: one read and one write of x
      $ NORMSWAP_BACKEND=eager normswap backends --json
    """
    from normswap import backends

    rows = backends.describe()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    plain = [r for r in rows if r["name"] != "auto"]
    width = max(len(r["name"]) for r in plain)
    click.echo(f"{'backend':{width + 2}} {'available':10} reason")
    for r in plain:
        click.echo(f"{r['name']:{width + 2}} {'yes' if r['available'] else 'no':10} {r['reason']}")
    click.echo("")
    autos = [r for r in rows if r["name"] == "auto"]
    for r in autos:
        if r.get("device_present", True):  # a device this machine lacks gets one line below, not its rules
            shape = "x".join(str(s) for s in r["shape"])
            click.echo(f"auto on {r['device']} {r['dtype']} {shape} -> {r['picks']}: {r['why']}")
    for device in dict.fromkeys(r["device"] for r in autos if not r.get("device_present", True)):
        click.echo(f"auto on {device}: no {device.upper()} device here (--json lists what auto would pick there)")


@main.command("bench")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="Where to run.")
@click.option("--dtype", "dtypes", multiple=True, default=("float32", "bfloat16"), show_default=True,
              help="Repeatable: float32, bfloat16, float16 (aliases fp32, bf16, fp16).")
@click.option("--shapes", default="4096x768,2048x4096,256x2048", show_default=True,
              help="Comma-separated ROWSxN shapes.")
@click.option("--pass", "passes", multiple=True, default=("fwd",), show_default=True,
              type=click.Choice(["fwd", "bwd", "fwd+bwd"]), help="Repeatable: bwd times the backward alone.")
@click.option("--rounds", default=7, show_default=True, help="Interleaved timing rounds per shape.")
@click.option("--target-ms", default=20.0, show_default=True,
              help="Length of one timing block (calls are repeated to fill it).")
@click.option("--compile", "compile_", is_flag=True, help="Also time torch.compile of the eager math.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write results and environment to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also write a PNG bar chart (needs matplotlib).")
@handle_errors
def bench_cmd(device: str, dtypes: tuple[str, ...], shapes: str, passes: tuple[str, ...], rounds: int,
              target_ms: float, compile_: bool, json_path: str | None, plot_path: str | None) -> None:
    """Time RMSNorm backends against torch layer_norm, F.rms_norm and a plain copy.

    Ratios are medians of per-round ratios (every method is timed once per round, interleaved), so
    they hold up on a busy machine better than absolute times. ``x copy`` is time relative to
    ``y.copy_(x)`` (the memory-speed floor for a forward pass).

    \b
    Example:
      $ normswap bench --dtype bf16 --shapes 4096x768,256x2048 --json bench.json
      pass     dtype           shape method           median us    GB/s x layer_norm  x copy
      fwd      bfloat16     4096x768 copy                  72.0   174.8         0.13    1.00
      fwd      bfloat16     4096x768 layer_norm           541.3    23.2         1.00    7.52
      fwd      bfloat16     4096x768 cpu                  190.0    66.2         0.35    2.64
      ...
      $ normswap bench --device cuda --pass fwd --pass fwd+bwd --compile
    """
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed: pip install matplotlib "
                "(or pip install 'normswap[plot]'), or drop --plot"
            ) from None
    import torch

    from normswap.backends import bench

    if device == "cuda" and not torch.cuda.is_available():
        raise NormswapError("--device cuda: no CUDA device here; use --device cpu")
    try:
        dts = [bench.parse_dtype(d) for d in dtypes]
        shape_list = bench.parse_shapes(shapes)
    except ValueError as exc:
        raise UsageError(f"{exc} (--dtype / --shapes)") from exc
    records = bench.run(device, dts, shape_list, passes, rounds=rounds, target_ms=target_ms,
                        compile_=compile_)
    click.echo(bench.table(records))
    spread, wide = spread_table(records)
    if spread:
        click.echo("")
        click.echo(spread)
    if wide:
        click.echo(
            f"warning: {len(wide)} ratio(s) vary more than {SPREAD_WARN}x between rounds (e.g. "
            f"{wide[0]}): the machine is busy; rerun when it is idle or with more --rounds",
            err=True,
        )
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(bench.to_json(records, bench.environment(device)), fh, indent=2)
        click.echo(f"wrote {json_path}")
    if plot_path and bench.plot(records, plot_path):
        click.echo(f"wrote {plot_path}")


def spread_table(records: list) -> tuple[str, list[str]]:
    """Min / median / max over rounds of each method's time ratio to layer_norm in the same round.

    Returns the table and the rows whose max/min exceeds :data:`SPREAD_WARN` (a busy machine
    makes ratios swing; the median alone hides it).
    """
    import statistics

    base = {(r.pass_, r.dtype, r.rows, r.n): r.samples_us for r in records if r.method == "layer_norm"}
    lines = [f"{'pass':8} {'dtype':9} {'shape':>11} {'method':15} {'x layer_norm: min':>18} {'median':>7} "
             f"{'max':>6}"]
    wide = []
    for r in records:
        ref = base.get((r.pass_, r.dtype, r.rows, r.n))
        if r.method == "layer_norm" or not ref or len(ref) != len(r.samples_us):
            continue
        ratios = [a / b for a, b in zip(r.samples_us, ref, strict=True) if b > 0]
        if not ratios:
            continue
        lo, med, hi = min(ratios), statistics.median(ratios), max(ratios)
        flag = " wide" if hi > SPREAD_WARN * lo else ""
        if flag:
            wide.append(f"{r.method} {r.dtype} {r.rows}x{r.n} {r.pass_}: {lo:.3g}-{hi:.3g}")
        lines.append(f"{r.pass_:8} {r.dtype:9} {f'{r.rows}x{r.n}':>11} {r.method:15} {lo:18.3g} {med:7.3g} "
                     f"{hi:6.3g}{flag}")
    return ("\n".join(lines) if len(lines) > 1 else ""), wide
