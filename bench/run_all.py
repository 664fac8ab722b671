"""Every bench in one go: machine floors, unickpt against DCP on the same state, memory peaks and
the planner simulation; ONE table, JSON under bench/results/.

    .venv/bin/python bench/run_all.py            # ~2 GB state, 3 rounds (make bench)
    .venv/bin/python bench/run_all.py --quick    # 0.25 GB state, 3 rounds (make bench QUICK=1)

Parts (each is the ``measure()`` function of a bench that also runs on its own):

  bench/save_load.py        floors (memcpy into reused memory, O_DIRECT write + fsync, buffered
                            write + fsync, cold and warm read), unickpt and DCP save (durable),
                            cold load into the same Shard(0) layout and cold resharded load into
                            Shard(1) column blocks (row -> column), 2 gloo ranks.
  bench/async_save.py       async save: blocking time (staging in the call; background staging
                            behind a compute phase), durable + committed, slowdown of a concurrent
                            compute loop; DCP's process checkpointer + shared-memory stager.
  bench/reshard_load.py     resharded cold loads per target layout (row->column, column->row,
                            ZeRO->TP, 2->3 ranks, row->TP x ZeRO on 4 ranks) on matrices 512 and
                            5120 columns wide (0.6 x the state size each; --quick: 512 only),
                            against the cold-read floor of the same job and DCP.
  bench/memory_tier.py      the in-memory tier on 2 simulated nodes of 2 ranks: snapshot blocking
                            against an async save to disk, compute slowdown with a snapshot every
                            step, replication, recovery from memory against a cold disk load.
  bench/compressed_save.py  saves with O0, O1, O2, O1 + zstd 3, lossless (and their cold loads), DCP's
                            save; the same on storage throttled to 200 MB/s per rank; the
                            mixed-precision table of docs/compression.md.
  bench/memory.py           peak extra RSS per rank: sync save, async save (trainer and writer),
                            load, export, offline reshard, each against its bound.
  bench/plan_scale.py       the save planner on 1,000 simulated ranks (its --quick), 3 layouts;
                            --quick: with --max-pieces 1.5e5 (the first layers that fit are
                            measured and the figures scaled linearly to 1,000 layers, as
                            plan_scale does and says).
  bench/fidelity.py         --quick: training after 1 and 5 quantized save/resume cycles (O1, O2)
                            on a small model, 3 seeds, against the seed spread and against 5
                            nudges of 1e-4 (the chaos floor); per-cycle update error (~2 min).
                            The full run (3 seeds x 300 steps x 10 cycles, ~30 min) on its own.
  bench/serving.py          a bf16 Llama (1 GB; --quick 0.25) published to tmpfs by a 2-rank FSDP2
                            trainer, a 2-rank TP inference job updating its fused model in place,
                            against the fused reference pass over the same bytes, a per-parameter
                            broadcast and export + from_pretrained (issue #41 item 3).
  bench/parse_dos.py        parser time on the hostile inputs tests/test_fuzz.py bounds by
                            counting (worst-case JSON shapes of 512 KiB, the huge-dims attacks,
                            decodes in 2^40-element groups): a few seconds, the same in --quick.

Every timing is the median over the rounds (>= 3) of the slowest rank; unickpt (A) and DCP (B)
run in ABBA order (A first in even rounds, B first in odd ones) inside every rank job. Columns:
"s" = median seconds; "GB/s" = state bytes / s; "x floor" = s / the machine floor of the same
bytes (saves: O_DIRECT write; loads: cold read; blocking: memcpy into reused memory), "x DCP" =
unickpt s / DCP s for the same operation (< 1: unickpt faster). Exit status 1, with a line
saying why, when a memory bound is exceeded or loaded data differ from what was saved.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import async_save, compressed_save, fidelity, memory, memory_tier, parse_dos, reshard_load, save_load, serving  # noqa: E402,E501
from bench._common import MiB, OUT, RESULTS, fmt, log, machine, my_segments, print_table, write_json  # noqa: E402

PARTS = ("save_load", "reshard", "async", "memtier", "compressed", "memory", "plan", "parse", "fidelity", "serving")
PRESETS = {  # state GB, rounds, compute loop s (async), memory rounds, plan_scale --max-pieces
    "quick": {"gb": 0.25, "repeats": 4, "loop_seconds": 1.0, "memory_repeats": 2, "plan_max_pieces": 1.5e5},
    "full": {"gb": 2.0, "repeats": 4, "loop_seconds": 3.0, "memory_repeats": 2, "plan_max_pieces": 1.5e6},
}


def plan_quick(max_pieces: float = 1.5e6) -> list[dict]:
    """bench/plan_scale.py --quick (1,000 ranks, 1,000 layers, every layout) with rule summaries
    (what saves use), its printed figures parsed. ``max_pieces`` is unused by the rule planner
    (it bounds the explicit one, ``plan_scale.py --explicit``)."""
    from bench import plan_scale as ps

    rows = []
    for layout in ("zero3", "tp8-zero", "dtensor2d", "fsdp2tp"):
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):  # the planner as saves run it: rule summaries
            ps.run_rules(layout, 1000, 1000, 256 << 20, True)
        text = buf.getvalue()

        def num(pat):
            m = re.search(pat, text)
            return float(m.group(1).replace(",", "")) if m else None

        rows.append({"layout": layout, "world": 1000, "measured_layers": 1000, "plan_s": num(r"plan/rank\s+([\d.]+) s"),
                     "peak_mib": num(r"peak mem\s+([\d.]+) MiB"), "manifest_mib": num(r"manifest\s+([\d.]+) MiB"),
                     "summary_kib": num(r"summary/rank\s+([\d.]+) KiB"), "text": text,
                     "wall_s": time.perf_counter() - t0})
        log(f"plan_scale {layout}: plan/rank {rows[-1]['plan_s']:.2f} s, peak {rows[-1]['peak_mib']:.0f} MiB")
    return rows


def table(res: dict) -> list[list[str]]:
    """The one table: [section, operation, s, GB/s, x floor, x DCP, note]."""
    rows: list[list[str]] = []

    def row(section, op, s=None, gbps=None, xf=None, xd=None, note=""):
        rows.append([section, op, fmt(s), fmt(gbps, ".2f"), fmt(xf, ".2f"), fmt(xd, ".2f"), note])

    if "save_load" in res:
        sl = res["save_load"]
        s, cfg = sl["summary"], sl["config"]
        ranks = cfg["ranks"]
        for op, name in (("memcpy", "copy into reused memory"), ("write_direct", "write O_DIRECT + fsync"),
                         ("write_buffered", "write buffered + fsync"), ("read_cold", "read cold"),
                         ("read_warm", "read warm (page cache)")):
            row("floor", name, s[op]["median"], s[op]["gbps"], note=f"{ranks} ranks, each its own file / buffer")
        row("floor", "read cold, the checkpoint's own files", s["files_unickpt_load"]["median"],
            s["files_unickpt_load"]["gbps"], note=f"{ranks} ranks, one contiguous share each, before each load (this: "
            "before the same-layout load): the floor of the loads below; x floor = median over rounds of load / its own read")
        for u, d, name, tgt in (("unickpt_save", "dcp_save", "save (durable, committed)", 1.15),
                                ("unickpt_load", "dcp_load", "load same layout, cold", 1.15),
                                ("unickpt_load_reshard", "dcp_load_reshard", "load resharded row->column, cold", 1.15)):
            note = f"target <= {tgt:.2f}x floor: {'met' if s[u]['x_floor'] <= tgt else 'MISSED'}"
            if u != "unickpt_save":
                note += f"; {s[u]['median'] / s['read_cold']['median']:.2f}x the fresh file"
            if u in save_load.VERIFY_OF:
                note += f"; verification {s[u]['verify_cost'] * 100:+.1f}%"
            row("unickpt", name, s[u]["median"], s[u]["gbps"], s[u]["x_floor"], s[u]["x_dcp"], note)
            row("DCP", name, s[d]["median"], s[d]["gbps"], s[d]["x_floor"], 1.0)
    if "reshard" in res:
        for r in res["reshard"]:
            cold = r["ranks"] <= reshard_load.CORES
            ok = (not cold or r["x_floor"] <= 1.15) and r["x_dcp"] <= 1.0
            row("unickpt", f"load {r['scenario']}, {r['width']} wide, {r['ranks']} ranks, cold", r["unickpt_s"],
                r["gb"] / r["unickpt_s"], r["x_floor"], r["x_dcp"],
                f"floor {r['floor_s']:.3f} s (fresh file {r['fresh_floor_s']:.3f} s, {r['x_fresh_floor']:.2f}x), "
                f"DCP {r['dcp_s']:.3f} s, read/need {r['read_over_need']:.2f}, floor read CPU {r['fresh_floor_cpu_s']:.2f} s "
                f"(worst round {r['fresh_floor_cpu_max_s']:.2f} s); target "
                + ("<= 1.15x floor, <= 1x DCP" if cold else "<= 1x DCP (more ranks than cores: the warm target)")
                + f": {'met' if ok else 'MISSED'}")
            for m, what in (("page", "page cache"), ("tmpfs", "tmpfs")):
                x = r[f"{m}_x_ref"]
                ok = x <= 1.3 and r[f"{m}_worst_rank_read_over_need"] <= 2.0 and (m != "page" or r["page_s"] <= r["dcp_warm_s"])
                row("unickpt", f"load {r['scenario']}, {r['width']} wide, {r['ranks']} ranks, warm ({what})", r[f"{m}_s"],
                    r["gb"] / r[f"{m}_s"], None, r["page_s"] / r["dcp_warm_s"] if m == "page" else None,
                    f"{x:.2f}x the fused reference ({r[f'{m}_ref_s']:.3f} s); CPU {r[f'{m}_cpu_per_gb']:.2f} s/GB read "
                    f"(reference {r[f'{m}_ref_cpu_per_gb']:.2f}); read/need {r[f'{m}_read_over_need']:.2f}, worst rank "
                    f"{r[f'{m}_worst_rank_read_over_need']:.2f}" + (f"; DCP warm {r['dcp_warm_s']:.3f} s" if m == "page" else "")
                    + f"; target <= 1.3x reference, <= 2x need{', <= 1x DCP' if m == 'page' else ''}: {'met' if ok else 'MISSED'}")
    if "async" in res:
        a = res["async"]["summary"]
        d = a["derived"]
        total = res["async"]["config"]["model"]["total_bytes"]
        med = lambda op, k: a[op][k]["median"]  # noqa: E731
        row("floor", "async: copy into reused memory", d["memcpy_floor"], total / d["memcpy_floor"] / 1e9)
        row("floor", "async: write O_DIRECT + fsync", d["disk_floor"], total / d["disk_floor"] / 1e9)
        for op, name, key in (("unickpt_async", "async save blocking (staging in the call)", "blocking"),
                              ("unickpt_bg", "async save blocking, staging behind compute", "blocking_bg")):
            v = med(op, "blocking")
            tgt = async_save.TARGETS[key]
            phase = (f"compute phase {med(op, 'work'):.3f} s ({res['async']['config'].get('phase_x', 1):g}x the "
                     "memcpy floor alone); " if op == "unickpt_bg" else "")
            row("unickpt", name, v, None, v / d["memcpy_floor"], v / d["dcp_best_blocking"],
                f"{phase}target <= {tgt:.2f}x DCP: {'met' if d['checks'][key] <= tgt else 'MISSED'}")
        row("DCP", "async save blocking (call + staging)", d["dcp_best_blocking"], None,
            d["dcp_best_blocking"] / d["memcpy_floor"], 1.0, res["async"]["config"]["meta"]["dcp_mode"])
        v, ref = med("unickpt_async", "durable"), med("dcp_async", "durable")
        row("unickpt", "async save durable + committed", v, total / v / 1e9, v / d["disk_floor"], v / ref,
            f"target <= 1.15x floor: {'met' if d['checks']['durable'] <= 1.15 else 'MISSED'}")
        row("DCP", "async save durable + committed", ref, total / ref / 1e9, ref / d["disk_floor"], 1.0)
        v, ref = med("unickpt_bg", "durable"), med("dcp_bg", "durable")
        row("unickpt", "async durable, staging behind compute", v, total / v / 1e9, v / d["disk_floor"], v / ref,
            f"streamed staging, the writer beside {med('unickpt_bg', 'work'):.3f} s of compute on the same cores "
            f"(from the call, so never below the phase); {d['checks']['durable_bg']:.2f}x floor, for information: "
            "#13's durable target is the row above")
        row("DCP", "async durable, staging behind compute", ref, total / ref / 1e9, ref / d["disk_floor"], 1.0)
        f = a["first_save"]
        row("unickpt", "first async save durable, writer + staging made by it", f["lazy"]["durable"], None,
            f["lazy"]["durable"] / d["disk_floor"], None, f"one sample; blocking {f['lazy']['blocking']:.3f} s")
        row("unickpt", "first async save durable, start_async_writer(state) first", f["early"]["durable"], None,
            f["early"]["durable"] / d["disk_floor"], None, f"one sample; blocking {f['early']['blocking']:.3f} s; "
            f"the start call {f['start_call']:.3f} s")
        alone = med("loop_alone", "work")
        row("unickpt", "compute loop slowdown during async save", d["slowdown_unickpt"], None, None,
            d["slowdown_ratio"], f"loop alone {alone:.2f} s; target <= 0.70x DCP: "
            f"{'met' if d['slowdown_ratio'] <= 0.7 else 'MISSED'}")
        row("DCP", "compute loop slowdown during async save", d["slowdown_dcp"], None, None, 1.0)
    if "memtier" in res:
        m = res["memtier"]
        row("unickpt", "memory snapshot blocking (4 ranks, 2 nodes, replicas 1)", m["snap_block"], None, None, None,
            f"async save to disk blocks {m['async_block']:.3f} s; target <= it: "
            f"{'met' if m['snap_block'] <= m['async_block'] else 'MISSED'}")
        row("unickpt", "memory snapshot committed on both nodes", m["snap_commit"], m["total_bytes"] / m["snap_commit"] / 1e9,
            note=f"replicated {m['replicated'] / 1e9:.2f} GB in {m['replicate_s']:.2f} s (writers)")
        ok = m["slowdown"] <= 0.15 * m["loop_alone"] and 2 * m["snapshots_taken"] >= m["loop_steps"]
        row("unickpt", "compute slowdown, a snapshot due every step", m["slowdown"], None, None, None,
            f"loop alone {m['loop_alone']:.2f} s ({m['slowdown'] / m['loop_alone'] * 100:.0f}% slower); "
            f"{m['snapshots_taken']:.0f} of {m['loop_steps']} steps snapshotted, the rest skipped while busy; "
            f"snapshot CPU {m['snap_cpu_per_gb']:.2f} s per GB; target <= 15%, at least half taken: {'met' if ok else 'MISSED'}")
        for key, disk, name in (("mem_load", "disk_load", "same layout"), ("mem_reshard", "disk_reshard", "resharded")):
            ok = m[key] <= 0.25 * m[disk] and m[f"{key}_x_ref"] <= 1.3
            row("unickpt", f"recovery from memory, {name}", m[key], m["total_bytes"] / m[key] / 1e9, None, None,
                f"cold disk load {m[disk]:.3f} s ({m[key] / m[disk]:.2f}x); {m[key + '_x_ref']:.2f}x the fused reference "
                f"({m[key + '_ref']:.3f} s); CPU {m[key + '_cpu_per_gb']:.2f} s/GB read; target <= 0.25x disk, <= 1.3x "
                f"reference: {'met' if ok else 'MISSED'}")
    if "compressed" in res:
        c = res["compressed"]
        st, floor, total = c["settings"], c["floor"], c["total_bytes"]
        o0 = st["O0"]
        for name, v in st.items():
            lib = "DCP" if name == "dcp" else "unickpt"
            load = f", cold load {v['load']:.3f} s ({v['load'] / o0['load']:.2f}x O0)" if "load" in v else ""
            row(lib, f"save {'(uncompressed)' if name == 'dcp' else name}", v["save"], total / v["save"] / 1e9,
                v["save"] / floor, None if name == "dcp" else v["save"] / st["dcp"]["save"],
                f"{v['bytes'] / 1e9:.3f} GB on disk ({v['bytes'] / o0['bytes']:.2f}x O0){load}")
        row("floor", "compressed: write O_DIRECT + fsync", floor, total / floor / 1e9)
        thr = c.get("throttled") or {}
        for name, v in thr.items():
            row("unickpt", f"save {name}, storage throttled to {c['throttle_mbps']:.0f} MB/s per rank", v["save"],
                total / v["save"] / 1e9, note=f"{v['save'] / thr['O0']['save']:.2f}x O0's throttled save; "
                f"load {v['load']:.3f} s")
        if thr:
            for line in compressed_save.target_lines(c):
                row("unickpt", "compression target", note=line)
        if c.get("table"):
            n = c["table_params"]
            for k, v in c["table"].items():
                t = c["table_throttled"][k]
                row("unickpt", f"mixed-precision state, {k}", v["save"], note=f"{v['bytes'] / n:.2f} bytes/param; "
                    f"save {v['save']:.2f} s, cold load {v['load']:.2f} s; throttled save {t['save']:.2f} s, "
                    f"load {t['load']:.2f} s")
    if "memory" in res:
        for r in res["memory"]["rows"]:
            extra = "unmeasured" if r["extra"] is None else f"{r['extra'] / MiB:.0f} MiB"
            row("memory", f"peak extra RSS: {r['what']}",
                note=f"{extra} <= {r['bound'] / MiB:.0f} MiB ({r['note']}): {'ok' if r['ok'] else 'EXCEEDED'}")
    if "plan" in res:
        for p in res["plan"]:
            row("planner", f"summarize + decode + make_plan + schedule, {p['layout']}, {p['world']} ranks", p["plan_s"], None, None,
                None, f"1000 layers, rule summaries ({p['summary_kib']:.1f} KiB/rank); target < 1 s/rank: "
                f"{'met' if p['plan_s'] < 1 else 'MISSED'}; peak {p['peak_mib']:.0f} MiB "
                f"(target < 256: {'met' if p['peak_mib'] < 256 else 'MISSED'}); manifest {p['manifest_mib']:.2f} MiB")
    if "serving" in res:
        sv = res["serving"]
        s = sv["slowest"]
        ref = s["reference"]
        need = max(r["needed"] for r in sv["ranks"])
        read = max(r["read"] for r in sv["ranks"])
        row("unickpt", f"live weight update, {sv['gb']} GB bf16 Llama, FSDP2 trainer (2) -> 2 TP ranks (fused)",
            s["update"], xf=s["update"] / ref, note=f"from step() returning; x floor = x the fused reference pass "
            f"({ref:.3f} s); target <= 1.3: {'met' if s['update'] <= 1.3 * ref else 'MISSED'}; a rank needs "
            f"{need / 2**20:.0f} MiB, reads {read / 2**20:.0f} MiB (the reference "
            f"{max(r['ref_read'] for r in sv['ranks']) / 2**20:.0f})")
        row("baseline", "per-parameter broadcast (gloo), whole model", s["broadcast"], xf=s["broadcast"] / ref)
        row("baseline", "export + from_pretrained + slicing by hand", s["export"], xf=s["export"] / ref)
        row("unickpt", "the publishing step() (FSDP2 trainer, bf16 to tmpfs)", s["publish"])
    if "fidelity" in res:
        f = res["fidelity"]["summary"]
        floor = next(c for c in f["cases"] if c["mode"] == "floor")
        for c in f["cases"]:
            if c["mode"] == "floor":
                continue
            pc = c.get("per_cycle", {})
            tgt = f"; target {c['target']}: {'met' if c['met'] else 'MISSED'}" if "target" in c else ""
            row("unickpt", f"fidelity {c['mode']} x{c['cycles']} cycles (quick model)",
                note=f"eval drift mean {c['mean_abs_drift']:.3%}, max {c['max_abs_drift']:.3%} over 3 seeds (seed spread "
                     f"{f['seed_spread']:.2%}, chaos floor x{floor['cycles']} {floor['mean_abs_drift']:.3%}); per cycle: "
                     f"update cos {pc.get('u_cos', float('nan')):.4f}, |u'|/|u| {pc.get('u_mean_abs_ratio', float('nan')):.4f}"
                     f"{tgt}")
    if "parse" in res:
        for r in res["parse"]:
            row("parser", f"{r['input']}, {r['bytes']:,} bytes", r["median"],
                note=f"worst run {r['max']:.4f} s; the limit tests/test_fuzz.py used to assert: {r['old_limit']:.1f} s "
                     f"({'under' if r['max'] < r['old_limit'] else 'OVER'})")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="0.25 GB state, 4 rounds, 1 s compute loop (a few minutes)")
    ap.add_argument("--gb", type=float, default=None, help="state size in GB (default 2.0; --quick 0.25)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds per timing (default 4, at least 3; even: ABBA then puts each first equally often)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--dir", default=os.path.join(OUT, "data"), help="scratch directory (on the real disk)")
    ap.add_argument("--json", default=None, help="default bench/results/run_all-{quick,full}-TIME.json")
    args = ap.parse_args()
    preset = dict(PRESETS["quick" if args.quick else "full"])
    if args.gb is not None:
        preset["gb"] = args.gb
    if args.repeats is not None:
        preset["repeats"] = args.repeats
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    gb, n, ranks = preset["gb"], preset["repeats"], args.ranks
    info = {"mode": "quick" if args.quick else "full", "preset": preset, "ranks": ranks, "parts": parts,
            "machine": machine(), "seconds": {}}
    log(f"run_all ({info['mode']}): {gb} GB, {ranks} ranks, {n} rounds; parts {', '.join(parts)}")
    res: dict = {}
    t_all = time.perf_counter()
    errors: dict[str, str] = {}
    for part in parts:
        t0 = time.perf_counter()
        try:
            if part == "save_load":
                res[part] = save_load.measure(gb, ranks, n, args.dir)
            elif part == "reshard":
                res[part] = reshard_load.measure(0.6 * gb, (512,) if args.quick else (512, 5120), n, args.dir)
            elif part == "memtier":
                res[part] = memory_tier.measure(gb, n, args.dir)
            elif part == "async":
                res[part] = async_save.measure(gb, ranks, n, preset["loop_seconds"], args.dir)
            elif part == "compressed":
                res[part] = compressed_save.measure(gb, ranks, n, args.dir)
            elif part == "memory":
                res[part] = memory.measure(gb, ranks, preset["memory_repeats"], args.dir)
            elif part == "plan":
                res[part] = plan_quick(preset["plan_max_pieces"])
            elif part == "parse":
                res[part] = parse_dos.measure(max(n, 5))
            elif part == "fidelity":
                res[part] = fidelity.measure(quick=True)
            elif part == "serving":
                res[part] = serving.measure(0.25 if args.quick else 1.0, n)
        except Exception as e:  # the other parts still run; the run fails at the end
            errors[part] = f"{type(e).__name__}: {e}"
            print(f"[bench] {part} FAILED:\n{traceback.format_exc()}", file=sys.stderr)
        info["seconds"][part] = time.perf_counter() - t0
        log(f"{part} {'FAILED' if part in errors else 'done'} in {info['seconds'][part]:.0f} s")
    info["seconds"]["total"] = time.perf_counter() - t_all

    m = res.get("save_load", {}).get("config", {}).get("model") or {}
    print(f"\nunickpt vs DCP, {info['mode']} run: {gb} GB fp32 GPT-like state (weights + 2 Adam moments"
          + (f", {m['total_bytes'] / 1e9:.3f} GB, hidden {m['hidden']}, {m['layers']} layers" if m else "")
          + f"), {ranks} gloo ranks, 1 thread each, medians of {n} rounds (slowest rank), ABBA order; "
          f"{info['machine']['cpus']} CPUs, load average {info['machine']['loadavg_at_start'][0]:.1f} at start")
    rows = table(res)
    print_table(["", "operation", "s", "GB/s", "x floor", "x DCP", "note"], rows, left=2, left_last=True)

    fails = [f"{part} did not run to the end: {e.splitlines()[0] if e else e}" for part, e in errors.items()]
    if "memory" in res:
        fails += memory.fail_lines(res["memory"])
    if "save_load" in res:
        bad = {k: v for k, v in res["save_load"]["verify"].items() if v}
        if bad:
            fails.append(f"LOADED DATA DIFFER from the saved state (tensors per operation): {bad}")
    wrong = [f"{r['scenario']} {r['width']}" for r in res.get("reshard", []) if r["bad"]]
    if res.get("memtier", {}).get("bad"):
        wrong.append("memory tier recovery")
    if wrong:
        fails.append(f"LOADED DATA DIFFER after resharded loads: {wrong}")
    left = my_segments()
    if left:
        fails.append(f"shared-memory segments left: {left}")
    info["fails"] = fails
    path = args.json or os.path.join(RESULTS, f"run_all-{info['mode']}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(path, {"info": info, "table": rows, "results": res})
    if not os.path.relpath(path, ROOT).startswith(".."):  # quoted in docs: no machine's directories
        path = os.path.relpath(path, ROOT)
    print(f"\ntook {info['seconds']['total'] / 60:.1f} min ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in info["seconds"].items() if k != "total") + f"); JSON: {path}")
    for f in fails:
        print(f"FAIL: {f}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
