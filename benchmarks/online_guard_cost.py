"""Host cost per call of the online-op guard (``normswap.rotation.carry.OpsGuard``), side by side, on one-token
decode steps of a GPT-2 with online Hadamards alone (``rotate(model, "none", online=True)``).

The guard is a forward pre-hook on the model that, before every call, compares the modules on the way to each
online op with the ones recorded (one tuple of ``dict.get`` and an identity comparison). Measured here:

* ``guard alone``: the hook called by itself (``guard(model, ())``), microseconds per call (mean of
  ``--calls`` calls, median over ``--rounds``);
* ``dispatch``: the same guard (a shallow copy: the same watched modules) as the only pre-hook of an empty
  module, against that module without it: what the guard adds to a call, torch's hook dispatch included
  (microseconds per call, fastest of ``--reps`` runs of ``--calls`` calls, median over ``--rounds``);
* ``round 51 / round 52``: since round 52 the guard checks, at every call, each op's entry in its module's hook
  dictionary (an op's hook removed from a module that stays in place is refused at the next call) and the edge
  into each op's module, not the edges above it (those are watched as ``setattr`` assigns them, through torch's
  module-registration hook); the round-51 guard checked every edge on the way. It is built here as the same hook
  over all the ``_modules`` edges and no hook entry (:func:`module_edges_only`). Both are timed alone and with
  the dispatch, alternated in each round (round 51, round 52, round 52, round 51), and the ratio of their means
  is taken per round;
* ``decode step``: one cached decoder token (``--past`` positions in the cache, cropped back after each step;
  a timing is the fastest of ``--reps`` runs of about ``--seconds`` of steps),
  eager, with the guard registered against the same model with it removed, timed in ABBA rounds
  (``dinov2_online_speed.abba``: without, with, without, with, without), ratio with / without per round, and
  the without-guard run's last against its first (the machine's noise).

* ``watched dictionaries`` (round 53): since round 53 the ``_modules`` dictionary of each module on the way to an
  op is a :class:`normswap.rotation.carry.WatchedModules` (a ``dict`` subclass that tells the guard of each write,
  so a write above an op is refused at the next call with no more work per call). Its reads are the ``dict``'s
  own, but CPython's specialised ``dict[key]`` path does not take subclasses, so each submodule read by
  ``nn.Module.__getattr__`` on those modules may cost a little more. Measured: a submodule read
  (``layer.mlp``), nanoseconds, watched against a plain ``dict`` with the same entries (ABBA, ``--calls``
  reads, median over ``--rounds``), and the decode step with the watched dictionaries against the same model
  with plain ones put back (ABBA rounds as for the guard).

* ``slots`` (round 54): round 54's guard also compared, at every call, the slot holding each watched dictionary
  (the owner's ``__dict__["_modules"]``), so that a ``_modules`` replaced whole was refused at the next call.
* ``round 55`` (``--slots-only``): since round 55 every ``_modules`` on the way to an op, the op's own parent too,
  is a watched dictionary held weakly (a write is told as it happens, one replaced whole as it is freed), so no
  ``_modules`` edge and no ``_modules`` slot is compared at the call; per op the guard compares its hook entry and
  the slot holding that hook dictionary (an op's hook dictionary replaced whole is refused at the next call).
  ``--slots-only`` times this guard alone and with the dispatch against round 54's (main's), rebuilt from the
  same model (:func:`round54`: the edge into each op's module in a plain copy of its parent's ``_modules``, the
  op's hook entry, the slot of each dictionary above an op's parent; the same ``__call__``), alternated as above.
  ``--decode`` adds the end-to-end cell: the decode step with round 55's layout (its guard, 39 watched
  dictionaries on GPT-2 small) against round 54's (its guard, the ops' parents back on plain dictionaries: 15
  watched), swapped in place on the same model between timings, ABBA rounds as above, with the A/A of round 54's.

Random weights (the guard's cost depends on the module tree, not the values), float32, one thread.

    OMP_NUM_THREADS=1 python benchmarks/online_guard_cost.py --json docs/results/online_guard_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dinov2_online_speed import abba  # noqa: E402

SIZES = {"small": {"n_layer": 12, "n_embd": 768, "n_head": 12}, "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4}}


def online_gpt2(size: str) -> torch.nn.Module:
    """A random GPT-2 (``SIZES[size]``) converted (β kept) with online Hadamards alone, eval, float32."""
    import transformers as tf

    import normswap
    from normswap.rotation.rotate import rotate

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1000, n_positions=256, **SIZES[size])).eval()
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=0)
    return model


def module_edges_only(guard: Callable) -> Callable:
    """A copy of ``guard`` checking, at every call, every ``_modules`` edge on the way to the ops and no hook
    entry: round 51's guard (the same ``__call__``, which since round 52 also reads one flag)."""
    import copy

    from normswap.rotation.carry import _target

    old = copy.copy(guard)
    old._set([(_target(e), *e[1:5], True) for e in guard.entries if _target(e) is e[3].__dict__["_modules"]])
    old.dirty = False
    return old


def round54(model: torch.nn.Module) -> tuple[Callable, Callable[[], Callable[[], None]]]:
    """Round 54's guard (main's before round 55) for ``model``, and the function that puts round 54's layout on
    the model (returning the one that takes it off again). Its checked entries, per op: the edge into the op's
    module in its parent's ``_modules`` (a plain ``dict`` in round 54: here a plain copy of it, the one the layout
    puts on the parent), the op's entry in its hook dictionary; and the slot (``owner.__dict__["_modules"]``) of
    each watched dictionary above an op's parent. The same ``OpsGuard.__call__`` (unchanged since round 52)."""
    from normswap.rotation.carry import OWNED, OpsGuard, WatchedModules, _hook_entry, held_ops

    ops = held_ops(model)
    parents = {p.rpartition(".")[0] for p in ops if p}
    above = {p[:i] if i > 0 else "" for p in parents for i in [0] + [k for k, c in enumerate(p) if c == "."]}
    above |= {q.rpartition(".")[0] for q in parents if q}
    above = {a for a in above if any(p != a and (a == "" or p.startswith(a + ".")) for p in parents)}
    plain = {p: dict(model.get_submodule(p).__dict__["_modules"]) for p in parents if p not in above}
    entries: list[tuple] = []
    for path in ops:
        parent_path, _, name = path.rpartition(".")
        parent, module = model.get_submodule(parent_path), model.get_submodule(path)
        d = plain.get(parent_path, parent.__dict__["_modules"])
        entries.append((d, name, module, parent, path, True))
        hook = _hook_entry(module, ops[path])
        entries.append((*hook, module, path, True))
    for a in sorted(above):
        owner = model.get_submodule(a)
        assert type(owner.__dict__["_modules"]) is WatchedModules
        entries.append((owner.__dict__, OWNED, owner.__dict__["_modules"], owner, a, True))
    guard = OpsGuard()
    guard._set(entries)

    def layout() -> Callable[[], None]:
        key, new = guard_of(model)
        watched = {p: model.get_submodule(p).__dict__["_modules"] for p in plain}
        for p, d in plain.items():
            model.get_submodule(p).__dict__["_modules"] = d
        model._forward_pre_hooks[key] = guard

        def back() -> None:
            for p, d in watched.items():
                model.get_submodule(p).__dict__["_modules"] = d
            model._forward_pre_hooks[key] = new
        return back
    return guard, layout


def paired(new: Callable, old: Callable, model: torch.nn.Module, rounds: int, calls: int, reps: int) -> dict:
    """The guard ``new`` against ``old``, alone and with the dispatch, alternated (old, new, new, old) per round."""
    out: dict = {"alone_us": [], "alone_us_old": [], "alone_ratio": [], "dispatch_us": [], "dispatch_us_old": [],
                 "dispatch_ratio": []}
    for _ in range(rounds):
        a = [alone_us(old, model, calls), alone_us(new, model, calls), alone_us(new, model, calls),
             alone_us(old, model, calls)]
        out["alone_us"].append((a[1] + a[2]) / 2), out["alone_us_old"].append((a[0] + a[3]) / 2)
        out["alone_ratio"].append(out["alone_us"][-1] / out["alone_us_old"][-1])
        d = [dispatch_us(old, calls, reps), dispatch_us(new, calls, reps), dispatch_us(new, calls, reps),
             dispatch_us(old, calls, reps)]
        out["dispatch_us"].append((d[1] + d[2]) / 2), out["dispatch_us_old"].append((d[0] + d[3]) / 2)
        out["dispatch_ratio"].append((d[1] + d[2]) / (d[0] + d[3]))
    return out


def alone_us(guard: Callable, model: torch.nn.Module, calls: int) -> float:
    """Microseconds per call of ``guard(model, ())``, the mean of ``calls`` calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        guard(model, ())
    return (time.perf_counter() - t0) / calls * 1e6


def guard_of(model: torch.nn.Module) -> tuple[int, Callable]:
    from normswap.rotation.carry import OpsGuard

    return next((k, h) for k, h in model._forward_pre_hooks.items() if isinstance(h, OpsGuard))


def watched_reads(model: torch.nn.Module, layout: Callable[[], Callable[[], None]], past: int) -> dict:
    """Submodule reads on a watched ``_modules`` (the subclass path of ``nn.Module.__getattr__``) in one decode
    step, with the model's own layout (round 55) and with round 54's put on it: counted by wrapping
    ``nn.Module.__getattr__`` for the step. Deterministic (no timing); times the per-read cost of
    ``benchmarks/watched_modules_read.py`` it gives the layout's cost per step."""
    from normswap.rotation.carry import WatchedModules

    timer = step_timer(model, past, 1)
    original = torch.nn.Module.__getattr__
    count = [0]

    def counting(self: torch.nn.Module, name: str) -> object:
        d = self.__dict__.get("_modules")
        if type(d) is WatchedModules and name in d:
            count[0] += 1
        return original(self, name)

    def counted() -> int:
        count[0] = 0
        torch.nn.Module.__getattr__ = counting
        try:
            timer()
        finally:
            torch.nn.Module.__getattr__ = original
        return count[0]

    own = counted()
    back = layout()
    try:
        r54 = counted()
    finally:
        back()
    return {"reads": own, "reads_r54": r54}


def decode_rows(model: torch.nn.Module, layout: Callable[[], Callable[[], None]], past: int, seconds: float,
                reps: int, rounds: int) -> dict:
    """The decode step with the model's own layout (round 55) against round 54's put on it in place (ABBA)."""
    steps = max(3, round(seconds / step_timer(model, past, 3)()))
    timer = step_timer(model, past, steps, reps)
    step_ms: list[float] = []

    def old() -> float:
        back = layout()
        try:
            return timer()
        finally:
            back()

    for _ in range(3):  # warm-up
        timer(), old()
    run = {"original": old, "guard": lambda: step_ms.append(timer()) or step_ms[-1]}
    ratios = abba(run, rounds)
    watched = sum(type(m.__dict__["_modules"]).__name__ == "WatchedModules" for m in model.modules())
    back = layout()
    watched54 = sum(type(m.__dict__["_modules"]).__name__ == "WatchedModules" for m in model.modules())
    back()
    return {"steps": steps, "step_ms": [s * 1e3 for s in step_ms], "watched_modules": watched,
            "watched_modules_r54": watched54, "step_r55_over_r54": ratios["guard"],
            "step_a_over_a": ratios["original (A/A)"]}


def step_timer(model: torch.nn.Module, past: int, steps: int, reps: int = 1) -> Callable[[], float]:
    """Seconds per one-token decode call with a cache of ``past`` positions (cropped back each time): the
    fastest of ``reps`` runs of ``steps`` calls (robust to other jobs taking the core now and then)."""
    ids = torch.randint(0, 1000, (1, past + 1))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :past], use_cache=True).past_key_values
    step = ids[:, past:]

    def seconds() -> float:
        best = float("inf")
        with torch.no_grad():
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(steps):
                    model(input_ids=step, past_key_values=cache, use_cache=True)
                    cache.crop(-1)  # back to `past` positions
                best = min(best, (time.perf_counter() - t0) / steps)
        return best
    return seconds


class Empty(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def dispatch_us(guard: Callable, calls: int, reps: int) -> float:
    """Microseconds the guard adds to a call of an empty module (with it minus without, each the fastest of
    ``reps`` runs of ``calls`` calls, alternated)."""
    import copy

    plain, hooked = Empty(), Empty()
    twin = copy.copy(guard)
    twin.dirty = guard.dirty  # as timed (a copy of round 51's or 53's entries would otherwise re-watch first)
    hooked.register_forward_pre_hook(twin)
    x = torch.zeros(1)
    best = {"plain": float("inf"), "hooked": float("inf")}
    for _ in range(reps):
        for name, m in (("plain", plain), ("hooked", hooked)):
            t0 = time.perf_counter()
            for _ in range(calls):
                m(x)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best["hooked"] - best["plain"]


def read_ns(owner: torch.nn.Module, name: str, calls: int) -> float:
    """Nanoseconds per ``getattr(owner, name)`` (a submodule read through ``nn.Module.__getattr__``)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        getattr(owner, name)
    return (time.perf_counter() - t0) / calls * 1e9


def plain_dicts(model: torch.nn.Module) -> Callable[[], None]:
    """Put plain ``dict`` copies in place of the model's :class:`WatchedModules` (the state before round 53);
    returns the function that puts the watched ones back."""
    from normswap.rotation.carry import WatchedModules

    watched = [(m, m.__dict__["_modules"]) for m in model.modules() if type(m.__dict__["_modules"]) is WatchedModules]
    for m, d in watched:
        m.__dict__["_modules"] = dict(d)

    def restore() -> None:
        for m, d in watched:
            m.__dict__["_modules"] = d
    return restore


def watched_rows(model: torch.nn.Module, timer: Callable[[], float], rounds: int, calls: int) -> dict:
    """Round 53: a submodule read and the decode step, watched ``_modules`` against plain ones (ABBA)."""
    layer = model.transformer.h[0]

    def plain_read() -> float:
        restore = plain_dicts(model)
        try:
            return read_ns(layer, "mlp", calls)
        finally:
            restore()

    def plain_step() -> float:
        restore = plain_dicts(model)
        try:
            return timer()
        finally:
            restore()

    reads, reads_plain, read_ratio = [], [], []
    for _ in range(rounds):
        r = [plain_read(), read_ns(layer, "mlp", calls), read_ns(layer, "mlp", calls), plain_read()]
        reads.append((r[1] + r[2]) / 2), reads_plain.append((r[0] + r[3]) / 2)
        read_ratio.append(reads[-1] / reads_plain[-1])
    for _ in range(2):
        timer(), plain_step()
    ratios = abba({"original": plain_step, "guard": timer}, rounds)
    watched = sum(type(m.__dict__["_modules"]).__name__ == "WatchedModules" for m in model.modules())
    return {"watched_modules": watched, "read_ns": reads, "read_ns_plain": reads_plain, "read_ratio": read_ratio,
            "step_watched_over_plain": ratios["guard"], "step_a_over_a": ratios["original (A/A)"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["small", "tiny"], choices=sorted(SIZES))
    ap.add_argument("--past", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=0.05, help="about this long per run of steps (its step count "
                    "is set from a first step)")
    ap.add_argument("--reps", type=int, default=5, help="runs of steps per timing; a timing is the fastest")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20000, help="guard calls per timing of the guard alone")
    ap.add_argument("--slots-only", action="store_true", help="round 55's guard against round 54's (main's), "
                    "nothing else (with --decode: the decode step too)")
    ap.add_argument("--reads-only", action="store_true", help="the watched submodule reads per decode step, "
                    "round 55's layout and round 54's (counted, not timed), nothing else")
    ap.add_argument("--decode", action="store_true", help="with --slots-only: the decode step, round 55's layout "
                    "against round 54's")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict = {"torch": torch.__version__, "past": args.past, "seconds": args.seconds, "reps": args.reps,
                 "rounds": args.rounds, "sizes": {}}
    for size in args.sizes:
        model = online_gpt2(size)
        key, guard = guard_of(model)
        if args.reads_only:
            out["sizes"][size] = row = watched_reads(model, round54(model)[1], args.past)
            print(f"{size}: watched submodule reads per decode step {row['reads']} (round 54's layout: "
                  f"{row['reads_r54']})", flush=True)
            if args.json:
                args.json.write_text(json.dumps(out, indent=1))
            continue
        if args.slots_only:
            r54, layout = round54(model)
            row = {"entries": len(guard.modules), "entries_r54": len(r54.modules),
                   **paired(guard, r54, model, args.rounds, args.calls, args.reps)}
            out["sizes"][size] = row
            med = statistics.median
            print(f"{size}: {row['entries']} checked entries (round 54: {row['entries_r54']}); guard alone "
                  f"{med(row['alone_us']):.2f} us/call (round 54's {med(row['alone_us_old']):.2f}, ratio "
                  f"{med(row['alone_ratio']):.3f}, range {min(row['alone_ratio']):.3f}-{max(row['alone_ratio']):.3f});"
                  f" with dispatch {med(row['dispatch_us']):.2f} (round 54's {med(row['dispatch_us_old']):.2f}, "
                  f"ratio {med(row['dispatch_ratio']):.3f})", flush=True)
            if args.decode:
                row["decode"] = d = decode_rows(model, layout, args.past, args.seconds, args.reps, args.rounds)
                print(f"{size}: decode step {med(d['step_ms']):.3f} ms; {d['watched_modules']} watched dicts "
                      f"(round 54: {d['watched_modules_r54']}); round 55 / round 54 {med(d['step_r55_over_r54']):.4f}"
                      f" (range {min(d['step_r55_over_r54']):.4f}-{max(d['step_r55_over_r54']):.4f}); A/A "
                      f"{med(d['step_a_over_a']):.4f} (range {min(d['step_a_over_a']):.4f}-"
                      f"{max(d['step_a_over_a']):.4f})", flush=True)
            if args.json:
                args.json.write_text(json.dumps(out, indent=1))
            continue
        r51 = module_edges_only(guard)
        alone, alone51, alone_ratio, dispatch, dispatch51, dispatch_ratio = [], [], [], [], [], []
        for _ in range(args.rounds):  # round 51, round 52, round 52, round 51
            a = [alone_us(r51, model, args.calls), alone_us(guard, model, args.calls)]
            a += [alone_us(guard, model, args.calls), alone_us(r51, model, args.calls)]
            alone.append((a[1] + a[2]) / 2), alone51.append((a[0] + a[3]) / 2)
            alone_ratio.append(alone[-1] / alone51[-1])
            d = [dispatch_us(r51, args.calls, args.reps), dispatch_us(guard, args.calls, args.reps)]
            d += [dispatch_us(guard, args.calls, args.reps), dispatch_us(r51, args.calls, args.reps)]
            dispatch.append((d[1] + d[2]) / 2), dispatch51.append((d[0] + d[3]) / 2)
            dispatch_ratio.append((d[1] + d[2]) / (d[0] + d[3]))
        steps = max(3, round(args.seconds / step_timer(model, args.past, 3)()))
        timer = step_timer(model, args.past, steps, args.reps)
        hooks = model._forward_pre_hooks

        def without(timer: Callable[[], float] = timer, hooks: dict = hooks, key: int = key) -> float:
            held = hooks.pop(key)
            try:
                return timer()
            finally:
                hooks[key] = held
                hooks.move_to_end(key, last=False)

        for _ in range(3):  # warm-up
            timer(), without()
        step_ms = []
        run = {"original": without,
               "guard": lambda timer=timer, step_ms=step_ms: step_ms.append(timer()) or step_ms[-1]}
        ratios = abba(run, args.rounds)
        row = {"edges": len(guard.modules), "edges_r51": len(r51.modules), "steps": steps, "guard_us": alone,
               "guard_us_r51": alone51, "guard_r52_over_r51": alone_ratio, "dispatch_us": dispatch,
               "dispatch_us_r51": dispatch51, "dispatch_r52_over_r51": dispatch_ratio,
               "step_ms": [s * 1e3 for s in step_ms], "ratio": ratios["guard"], "a_over_a": ratios["original (A/A)"]}
        row["round53"] = watched_rows(model, timer, args.rounds, args.calls)
        out["sizes"][size] = row
        med = statistics.median
        w = row["round53"]
        print(f"{size}: {w['watched_modules']} watched _modules dicts; a submodule read {med(w['read_ns']):.1f} ns "
              f"(plain dict {med(w['read_ns_plain']):.1f}, ratio {med(w['read_ratio']):.3f}); decode step watched / "
              f"plain {med(w['step_watched_over_plain']):.4f} (range {min(w['step_watched_over_plain']):.4f}-"
              f"{max(w['step_watched_over_plain']):.4f}); A/A {med(w['step_a_over_a']):.4f}")
        print(f"{size}: {row['edges']} watched entries (round 51: {row['edges_r51']}); guard alone {med(alone):.2f} "
              f"us/call (round 51's {med(alone51):.2f}, ratio {med(alone_ratio):.3f}); with dispatch "
              f"{med(dispatch):.2f} (round 51's {med(dispatch51):.2f}, ratio of the pair's sums "
              f"{med(dispatch_ratio):.3f})")
        print(f"{size}: {row['edges']} watched entries; guard alone {med(alone):.2f} us/call; with dispatch "
              f"{med(dispatch):.2f} us/call; decode step "
              f"{med(row['step_ms']):.3f} ms; with / without guard {med(row['ratio']):.4f} "
              f"(range {min(row['ratio']):.4f}-{max(row['ratio']):.4f}); A/A {med(row['a_over_a']):.4f} "
              f"(range {min(row['a_over_a']):.4f}-{max(row['a_over_a']):.4f}); guard / step "
              f"{med(alone) / (med(row['step_ms']) * 1e3):.5f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
