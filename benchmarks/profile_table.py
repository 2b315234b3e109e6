"""Where a profiled program spends its device time: a per-kernel table of a `jax.profiler` trace, read offline on
any machine (no TensorFlow, no TensorBoard).

  python benchmarks/profile_table.py DIR          # what `accelerator.py --profile --out=DIR` wrote
  python benchmarks/profile_table.py trace.tar.gz --top=40
  python benchmarks/profile_table.py DIR --regions=decode,train
  python benchmarks/profile_table.py --smoke      # traces a tiny program on this machine and prints its table

It reads the Chrome-trace JSON JAX's profiler writes beside its .xplane.pb (plugins/profile/<run>/<host>.trace.json.gz,
or perfetto_trace.json.gz), from a trace directory, a .tar.gz of one (accelerator.py's trace.tar.gz), or the file
itself. Kernels are the events on the device's stream threads (a GPU; a TPU's 'XLA Ops' line); where the trace has
no device (XLA:CPU), the XLA op events of the host threads, nested ones (a while loop's body) counted once, by their
leaves. Events are split by the host annotations of the regions (`jax.profiler.TraceAnnotation('decode')`; an
event belongs to the region it starts in; none found: one region of everything) and each region gets a table: kernel
name (with its program, where the trace names it), calls, total ms, mean µs, and share of the region's kernel time
(summed over streams), its top --top kernels; and the region's kernel time by kind of kernel (KINDS: attention,
matmul, copy, scatter/gather, reduce, elementwise/other), read from the kernels' names.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

TRACE_SUFFIXES = (".trace.json.gz", "perfetto_trace.json.gz")  # preferred first
# Lines the profiler derives on a device from the kernels (a module's span, its ops, steps): never kernels themselves.
DERIVED = {"XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops", "Framework Name Scope", "Source code",
           "TensorFlow Ops", "TensorFlow Name Scope", "Launch Stats"}


def _pick(names: list[str]) -> str | None:
    """The trace file to read among `names`: the latest run's JAX trace, else its Perfetto one."""
    for suffix in TRACE_SUFFIXES:
        found = sorted(n for n in names if n.endswith(suffix))
        if found:
            return found[-1]  # run folders are named by their start time
    return None


def load_trace(path: str | Path) -> dict:
    """The trace JSON ({'traceEvents': [...]}) from a trace directory, a .tar.gz of one, or a .json(.gz) file."""
    path = Path(path)
    if path.is_dir():
        name = _pick([str(p) for p in path.rglob("*") if p.is_file()])
        if name is not None:
            return load_trace(name)
        for tar in sorted(path.glob("*.tar.gz"), key=lambda p: p.name != "trace.tar.gz"):  # accelerator.py's first
            with tarfile.open(tar) as t:
                if _pick(t.getnames()):
                    return load_trace(tar)
        raise FileNotFoundError(f"{path}: no *.trace.json.gz, perfetto_trace.json.gz or .tar.gz holding one")
    if path.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path) as tar:
            name = _pick(tar.getnames())
            if name is None:
                raise FileNotFoundError(f"{path}: holds no *.trace.json.gz or perfetto_trace.json.gz")
            data = tar.extractfile(name).read()
        return json.loads(gzip.decompress(data))
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.name.endswith(".gz") else data)


def _leaves(events: list[dict]) -> list[dict]:
    """The events of one thread that contain no other: a parent (a while loop around its body's ops) is left out."""
    events = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
    return [e for e, nxt in zip(events, events[1:] + [None])
            if nxt is None or nxt["ts"] >= e["ts"] + e.get("dur", 0)]


def kernel_events(trace: dict) -> tuple[list[dict], str]:
    """(the kernel events, where they came from): the device processes' stream threads, or their 'XLA Ops' line,
    or else (no device in the trace: XLA:CPU) the host's XLA op events, leaves only."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    procs = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") ==
             "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    devices = {pid for pid, name in procs.items() if name.startswith("/device:")}
    on_device = [e for e in spans if e["pid"] in devices]
    if on_device:
        for pick, label in ((lambda n: "stream" in n.lower(), "stream threads"), (lambda n: n == "XLA Ops", "XLA Ops"),
                            (lambda n: n not in DERIVED, "all threads but the derived ones")):
            chosen = [e for e in on_device if pick(threads.get((e["pid"], e.get("tid")), ""))]
            if chosen:
                names = sorted({procs[e["pid"]] for e in chosen})
                return chosen, f"{', '.join(names)}: {label}"
    ops = defaultdict(list)
    for e in spans:
        if "hlo_op" in e.get("args", {}) and not e["name"].startswith("end: "):
            ops[(e["pid"], e.get("tid"))].append(e)
    return [e for thread in ops.values() for e in _leaves(thread)], "host XLA op events (no device in the trace)"


def regions(trace: dict, names: list[str]) -> dict[str, list[tuple[float, float]]]:
    """The (start, end) intervals (µs) of the annotation events named `names`, per name, on any host thread."""
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for e in trace.get("traceEvents", []):
        if isinstance(e, dict) and e.get("ph") == "X" and e.get("name") in out:
            out[e["name"]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    return {n: spans for n, spans in out.items() if spans}


def kernel_rows(events: list[dict]) -> list[dict]:
    """Per kernel (its program and name): calls, total µs, mean µs and share of the events' total time, the largest
    total first. Programs come from the events' `hlo_module` ('' where the trace names none)."""
    calls, total = defaultdict(int), defaultdict(float)
    for e in events:
        key = (e.get("args", {}).get("hlo_module", ""), e["name"])
        calls[key] += 1
        total[key] += e.get("dur", 0.0)
    whole = sum(total.values()) or 1.0
    return [{"program": k[0], "kernel": k[1], "calls": calls[k], "total_us": total[k], "mean_us": total[k] / calls[k],
             "share": total[k] / whole} for k in sorted(total, key=lambda k: -total[k])]


def split(trace: dict, names: list[str]) -> tuple[dict[str, dict], str]:
    """({region: {'wall_us', 'events'}}, the events' source): the kernel events split by the regions they start in
    (no region found: one named 'all')."""
    events, source = kernel_events(trace)
    out = {name: {"wall_us": sum(b - a for a, b in spans),
                  "events": [e for e in events if any(a <= e["ts"] <= b for a, b in spans)]}
           for name, spans in regions(trace, names).items()}
    if not any(part["events"] for part in out.values()):  # no regions, or a device clock apart from the host's
        return {"all": {"wall_us": None, "events": events}}, source + (", none inside a region" if out else "")
    return out, source


# What a kernel is, from its name (first match): a region's time by kind says at a glance what a step is made of
# (a decode step should be its attention kernel and the weight matmuls; the rest is what to look into).
KINDS = (("attention", ("paged_decode", "flash_segments", "mha", "paged_attention", "flash_attention")),
         ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "ampere_", "cublas", "dot", "convolution")),
         ("copy", ("memcpy", "copy", "memset")),
         ("scatter/gather", ("scatter", "gather", "dynamic_update_slice", "dynamic-update-slice")),
         ("reduce", ("reduce",)))


def kind_of(kernel: str) -> str:
    """The KINDS name a kernel's name falls under; 'elementwise/other' where none does."""
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(m in name for m in marks)), "elementwise/other")


def _short(name: str, width: int) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= width else name[: width - 1] + "…"


def report(trace: dict, names: list[str] = ("decode", "train"), top: int = 20, width: int = 80) -> str:
    """Markdown: per region, its wall time, kernel time and programs, then its top `top` kernels."""
    parts, source = split(trace, list(names))
    lines = [f"Kernels: {source}."]
    for name, part in parts.items():
        rows = kernel_rows(part["events"])
        busy = sum(r["total_us"] for r in rows)
        programs = defaultdict(float)
        for r in rows:
            programs[r["program"]] += r["total_us"]
        wall = "" if part["wall_us"] is None else f"wall {part['wall_us'] / 1e3:.3f} ms, "
        lines += ["", f"## {name}: {wall}kernel time {busy / 1e3:.3f} ms in {len(part['events'])} calls of "
                      f"{len(rows)} kernels", ""]
        named = set(programs) != {""}
        if named:
            lines += ["programs: " + ", ".join(f"{m or '?'} {t / (busy or 1):.0%}" for m, t in
                                               sorted(programs.items(), key=lambda x: -x[1])), ""]
        kinds = defaultdict(float)
        for r in rows:
            kinds[kind_of(r["kernel"])] += r["total_us"]
        lines += ["by kind: " + ", ".join(f"{k} {t / 1e3:.3f} ms ({t / (busy or 1):.0%})" for k, t in
                                          sorted(kinds.items(), key=lambda x: -x[1])), ""]
        head = "| program " * named + "| kernel | calls | total ms | mean µs | share |"
        lines += [head, "|---" * head.count(" | ") + "|---|"]
        lines += ["| " + f"{r['program'] or '?'} | " * named + f"{_short(r['kernel'], width)} | {r['calls']} | "
                  f"{r['total_us'] / 1e3:.3f} | {r['mean_us']:.1f} | {r['share']:.1%} |" for r in rows[:top]]
        if len(rows) > top:
            rest = rows[top:]
            lines.append("| " + "| " * named + f"({len(rest)} more) | {sum(r['calls'] for r in rest)} | "
                         f"{sum(r['total_us'] for r in rest) / 1e3:.3f} | — | {sum(r['share'] for r in rest):.1%} |")
    return "\n".join(lines) + "\n"


def smoke_trace(directory: Path) -> Path:
    """Traces a tiny jitted program under 'decode' and 'train' annotations into `directory`; returns it."""
    import jax
    import jax.numpy as jnp

    def body(x, w):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=4)[0].sum()

    step = jax.jit(body)
    grad = jax.jit(jax.grad(body, argnums=1))
    x, w = jnp.ones((64, 128)), jnp.full((128, 128), 0.01)
    jax.block_until_ready((step(x, w), grad(x, w)))  # compiled before the trace
    with jax.profiler.trace(str(directory)):
        with jax.profiler.TraceAnnotation("decode"):
            jax.block_until_ready(step(x, w))
        with jax.profiler.TraceAnnotation("train"):
            jax.block_until_ready(grad(x, w))
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", help="a trace directory, a .tar.gz of one, or a *.trace.json.gz file")
    ap.add_argument("--regions", default="decode,train", help="host annotation names to split the kernels by")
    ap.add_argument("--top", type=int, default=20, help="kernels per region")
    ap.add_argument("--width", type=int, default=80, help="kernel names are cut to this many characters")
    ap.add_argument("--smoke", action="store_true", help="trace a tiny program here (seconds) and print its table")
    args = ap.parse_args()
    if args.smoke:
        args.path = str(smoke_trace(Path(tempfile.mkdtemp(prefix="arealjax_profile_table_"))))
    elif not args.path:
        ap.error("a trace path is needed (or --smoke)")
    trace = load_trace(args.path)
    sys.stdout.write(report(trace, [r for r in args.regions.split(",") if r], args.top, args.width))


if __name__ == "__main__":
    main()
